"""Optimizers and the learning-rate schedule of the reference recipe."""

import math

import torch

from bayesncl_pyro.errors import UserError

WARMUP_START_LR = 3e-5  # the reference warms every group up from this absolute lr


class LARS(torch.optim.Optimizer):
    """SGD with momentum and a layer-wise trust ratio (You et al., 2017), as solo-learn uses it.

    For every weight with more than one dimension the step is ``g + wd * w`` scaled by
    ``eta * ||w|| / (||g|| + wd * ||w||)``, capped at 1 relative to the group lr (``clip_lr``), or, when ``||w||`` or
    ``||g||`` is 0, the plain gradient ``g``, without weight decay (solo-learn's LARS); biases, norm layers and other
    1-D parameters take plain SGD steps without weight decay.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.02, clip_lr: bool = True, eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                                      clip_lr=clip_lr, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        """Take one LARS step on every parameter with a gradient (``closure`` is accepted and not called)."""
        # foreach ops: a few kernels for all of a group's tensors, where one op per parameter would launch hundreds
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            wd, lr = group["weight_decay"], group["lr"]
            updates = [p.grad for p in params]
            scaled = [k for k, p in enumerate(params) if p.ndim > 1]
            if scaled:
                weights, grads = [params[k] for k in scaled], [updates[k] for k in scaled]
                p_norm, g_norm = torch.stack(torch._foreach_norm(weights)), torch.stack(torch._foreach_norm(grads))
                trust = group["eta"] * p_norm / (g_norm + wd * p_norm + group["eps"])
                if group["clip_lr"]:
                    trust = (trust / lr).clamp(max=1.0)
                # tensors, not Python branches: no host sync per parameter. Where a norm is 0 the step is g: with
                # ||w|| = 0, g + wd * w is g; with ||g|| = 0, g is 0, so the decayed step is scaled to 0
                trust = torch.where(g_norm > 0, torch.where(p_norm > 0, trust, 1.0), 0.0)
                decayed = torch._foreach_add(grads, weights, alpha=wd)
                # one kernel per tensor: foreach's fused path takes a list of tensors of equal shapes, or host scalars
                # (a host sync), not one device scalar per tensor
                torch._foreach_mul_(decayed, list(trust.unbind()))
                for k, update in zip(scaled, decayed):
                    updates[k] = update
            buffers, their_updates = [], []
            for p, update in zip(params, updates):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = update.clone()
                else:
                    buffers.append(state["momentum_buffer"])
                    their_updates.append(update)
            if buffers:
                torch._foreach_mul_(buffers, group["momentum"])
                torch._foreach_add_(buffers, their_updates)
            steps = [self.state[p]["momentum_buffer"] for p in params]
            if torch.is_tensor(lr):  # read on the device (a CUDA graph's replays follow the schedule)
                torch._foreach_add_(params, torch._foreach_mul(steps, -lr))
            else:
                torch._foreach_add_(params, steps, alpha=-lr)


def build_optimizer(name: str, groups: list[dict], momentum: float, weight_decay: float, lr_on_device: bool = False):
    """Build the optimizer ``name`` (``lars``, ``sgd`` or ``adamw``) over the parameter ``groups``.

    ``lr_on_device``: each group's learning rate a 0-d tensor on its parameters' device, which the schedule writes
    in place and the step reads there, so that a CUDA graph of the step follows the schedule (``--cuda-graphs``);
    torch's SGD reads it back to the host at every step, so it is refused.
    """
    groups = [dict(g, weight_decay=g.get("weight_decay", weight_decay)) for g in groups]
    if lr_on_device:
        if name == "sgd":
            raise UserError("--cuda-graphs needs --optimizer lars or adamw: torch's SGD reads its learning rate on the "
                            "host at every step, which a CUDA graph cannot do")
        groups = [dict(g, lr=torch.tensor(float(g["lr"]), device=g["params"][0].device)) for g in groups]
    if name == "lars":
        return LARS(groups, lr=groups[0]["lr"], momentum=momentum)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=groups[0]["lr"], momentum=momentum)
    if name == "adamw":
        # capturable on CUDA: the step count lives on the GPU with the moments, so that the divergence guard can undo
        # a bad step there (train/guard.py) without the host reading anything
        on_gpu = any(p.is_cuda for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=groups[0]["lr"], capturable=on_gpu)
    raise ValueError(f"unknown optimizer {name!r}")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict):
    """Run ``optimizer.load_state_dict(state)``, keeping this optimizer's ``capturable`` (AdamW's: True on CUDA).

    torch restores the saved flag and places the step counts by it, so a checkpoint written on a CPU would resume on a
    GPU with its step counts on the CPU, which the divergence guard's masked step cannot write into, and one written on
    a GPU would resume on a CPU as capturable, which AdamW refuses. So torch is handed the kept flag with the state,
    and places each step count by it: float32 on its parameter's device when capturable, else as loaded (on the CPU,
    where checkpoints are read to). The learning rates keep this optimizer's kind too (``build_optimizer``'s
    ``lr_on_device``: its tensors, filled with the saved values).
    """
    _check_state_tensors(optimizer, state)
    groups = [dict(saved, capturable=mine["capturable"]) if "capturable" in mine else saved  # SGD, LARS: no flag
              for saved, mine in zip(state["param_groups"], optimizer.param_groups)]
    mine = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict({**state, "param_groups": groups})
    for group, kept in zip(optimizer.param_groups, mine):
        for key in ("lr", "initial_lr"):
            if key in group:
                value = float(group[key])
                group[key] = kept[key].fill_(value) if torch.is_tensor(kept.get(key)) else value


def _check_state_tensors(optimizer: torch.optim.Optimizer, state: dict):
    """Refuse a saved optimizer state whose buffers are not those of this optimizer's parameters.

    torch copies each buffer into its parameter's dtype and device as it loads, materialising it: a small file can
    hold a buffer of 2^31 elements that all share one stored value (stride 0), and loading it would allocate 8 GiB. So
    each buffer must have its parameter's shape, a floating dtype and as many stored elements as it has; a step count
    is one element. A ValueError names the first that is not.
    """
    groups = state.get("param_groups", [])
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the saved optimizer has {len(groups)} parameter groups, this one "
                         f"{len(optimizer.param_groups)}")
    params = {}
    for saved, mine in zip(groups, optimizer.param_groups):
        if len(saved.get("params", [])) != len(mine["params"]):
            raise ValueError(f"a saved parameter group holds {len(saved.get('params', []))} parameters, this "
                             f"optimizer's {len(mine['params'])}")
        params.update(zip(saved["params"], mine["params"]))
    for index, buffers in state.get("state", {}).items():
        if index not in params:
            raise ValueError(f"the saved optimizer state names parameter {index!r}, which no group holds")
        param = params[index]
        for name, value in buffers.items():
            if not torch.is_tensor(value):
                continue
            stored = value.untyped_storage().nbytes() // max(1, value.element_size())
            if value.numel() > 1 and (value.shape != param.shape or not value.is_floating_point()):
                raise ValueError(f"the saved {name!r} of parameter {index} is {value.dtype} of shape "
                                 f"{tuple(value.shape)}, its parameter {param.dtype} of shape {tuple(param.shape)}")
            if stored < value.numel():
                raise ValueError(f"the saved {name!r} of parameter {index} has {value.numel()} elements on "
                                 f"{stored} stored values (a broadcast view): loading it would materialise it")


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, base_lr: float) -> float:
    """Multiplier of ``base_lr`` at ``step``: linear from WARMUP_START_LR to base_lr, then cosine to 0."""
    if step < warmup_steps:
        start = min(WARMUP_START_LR / base_lr, 1.0)
        return start + (1 - start) * step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def build_scheduler(optimizer, warmup_steps: int, total_steps: int):
    """Per-iteration LambdaLR, one warm-up/cosine curve per group (each relative to its own lr)."""
    lambdas = [lambda s, lr=float(g["lr"]): warmup_cosine(s, warmup_steps, total_steps, lr)
               for g in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    scheduler.base_lrs = [float(lr) for lr in scheduler.base_lrs]
    return scheduler


def load_scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler, state: dict):
    """Run ``scheduler.load_state_dict(state)``, keeping the base rates floats.

    With ``lr_on_device`` torch keeps them as the groups' device tensors, and a checkpoint's would come back as CPU
    tensors that the schedule then writes into the groups of an optimizer without ``lr_on_device`` (a resume without
    ``--cuda-graphs``): its rates would become CPU tensors. Floats fill device rates in place as well.
    """
    scheduler.load_state_dict(state)
    scheduler.base_lrs = [float(lr) for lr in scheduler.base_lrs]


def rescale_prior_group(optimizer: dict, scheduler: dict, kl_weight: float, name: str):
    """Put a checkpoint's optimizer and scheduler state (``state_dict``s, changed in place) in the current units.

    Before the head divided the prior's gradients by lambda (``kl_weight``), its ``prior`` group (one without
    ``grad_scale``) trained on raw gradients at lr gate_lr / lambda (SGD, LARS) or gate_lr (AdamW, ``name``); the
    resumed run then takes the steps the old one would have taken.
    """
    for i, group in enumerate(optimizer["param_groups"]):
        if group.get("name") != "prior" or "grad_scale" in group:
            continue
        group["grad_scale"] = 1.0 / kl_weight
        moments = [optimizer["state"][p] for p in group["params"] if p in optimizer["state"]]
        if name == "adamw":  # scale-free: its moments take the new gradients' scale
            for m in moments:
                m["exp_avg"], m["exp_avg_sq"] = m["exp_avg"] / kl_weight, m["exp_avg_sq"] / kl_weight**2
            continue
        for key in ("lr", "initial_lr"):
            group[key] = group[key] * kl_weight
        for m in moments:
            if m.get("momentum_buffer") is not None:
                m["momentum_buffer"] = m["momentum_buffer"] / kl_weight
        for key in ("base_lrs", "_last_lr"):
            if key in scheduler:
                scheduler[key][i] = scheduler[key][i] * kl_weight
