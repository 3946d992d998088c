"""Data-parallel training under ``torchrun``: process group, global negatives, rank-0-only side effects.

Each rank's loss is the plain ``-ELBO / num_rows`` of its local batch, whose gradient, averaged by DDP, is the
global batch's: docs/METHOD.md, "Data-parallel training". The control messages go over a gloo group on the CPU;
several machines, stops and restarts: docs/RELIABILITY.md, "Several processes and machines".
"""

import os

import torch
import torch.distributed as dist

from bayesncl_pyro.errors import UserError

_control = None  # the group of the control messages: gloo, on the CPU, whatever the training backend


def local_rank() -> int | None:
    """This process's GPU number among those of its machine under torchrun (LOCAL_RANK), None in a plain run."""
    return int(os.environ.get("LOCAL_RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None


def setup(device: torch.device) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes, if any, and return (rank, world size, device).

    ``device`` is what ``device.pick_device`` resolved (under torchrun: this
    process's GPU). Makes a GPU the current device of the calling thread, and joins the process group that torchrun
    describes in the environment (nccl on CUDA, gloo on CPU; the control messages' gloo group besides) when
    WORLD_SIZE > 1; a plain run is rank 0 of 1.
    """
    global _control
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, device
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
        raise UserError("torchrun --max-restarts shares its rendezvous store with the workers, so a restarted group "
                        "may read the previous group's addresses and hang; export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                        "before torchrun (each group then gets a store of its own)")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        _control = dist.new_group(backend="gloo")
    return dist.get_rank(), dist.get_world_size(), device


def world_size() -> int:
    """The number of processes training together (1 outside a process group)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def gather_rows(u: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Gather all ranks' rows, with gradients flowing back to each row's rank.

    The ``ContrastiveModel.gather`` hook, this rank's rows (R x K) -> (all ranks' rows in rank order,
    W R x K; the offset of ours). Gradients flow back to the rank that owns each row, so every rank's
    negatives train every encoder. Outside a process group of several ranks: ``(u, 0)``.
    """
    if world_size() == 1:
        return u, 0
    return _GatherRows.apply(u), dist.get_rank() * u.shape[0]


class _GatherRows(torch.autograd.Function):
    """All ranks' rows; backward: the sum over ranks of their losses' gradients for ours.

    Written here, as
    solo-learn and lightly do, because ``torch.distributed.nn.functional.all_gather`` is deprecated (torch 2.14 warns)
    for a private module, and took another path on nccl (reduce-scatter) than on gloo (all-to-all), the one
    tests run: here one all-reduce serves both (W times the traffic of a reduce-scatter, R x K floats a rank).
    """

    @staticmethod
    def forward(ctx, u: torch.Tensor) -> torch.Tensor:
        ctx.rows = u.shape[0]
        u = u.contiguous()
        # the list form: all_gather_into_tensor is deprecated in torch 2.14, all_gather_single absent before it
        rows = [torch.empty_like(u) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, u)
        return torch.cat(rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone(memory_format=torch.contiguous_format)  # all_reduce writes in place
        dist.all_reduce(total)
        start = dist.get_rank() * ctx.rows
        return total[start:start + ctx.rows]


def all_gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order (a single-process run gets ``[obj]``)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=_control)
    return out


def check_agreement(settings: dict):
    """Raise ``UserError`` unless every rank has the same ``settings``.

    One gather over the control group, at start-up.
    The ranks must gather rows of the same number and width at every step (``_GatherRows``: NCCL checks neither, and a
    mismatch hangs or mixes rows up) and take the same steps and checkpoints (each a collective). Every rank raises the
    same error; a single process has nothing to check.
    """
    everyone = all_gather_objects(settings)
    differ = [k for k in settings if any(other.get(k) != settings[k] for other in everyone)]
    if differ:
        raise UserError("the processes disagree on " + "; ".join(
            f"{k} ({', '.join(f'rank {r}: {other.get(k)!r}' for r, other in enumerate(everyone))})" for k in differ)
            + "; start every process with the same command and the same data")


class Votes:
    """Small non-negative integers that each rank posts at every step, combined by max over ranks.

    Under DDP a
    step's votes are exchanged on the CPU in the background and read at the next step: the exchange neither
    waits on the GPU nor stalls a step, and every rank reads the same result at the same step. A single
    process reads its own votes at once.
    """

    def __init__(self):
        self.pending = None

    def __call__(self, *votes: int) -> list[int]:
        """Post this step's ``votes`` and return the previous step's, maxed over ranks."""
        if not dist.is_initialized():
            return list(votes)
        posted = torch.tensor(votes, dtype=torch.int64)
        work = dist.all_reduce(posted, op=dist.ReduceOp.MAX, group=_control, async_op=True)
        previous, self.pending = self.pending, (work, posted)
        return self._read(previous) if previous else [0] * len(votes)

    def close(self):
        """Wait for the last exchange (every rank posted it), so that none is left behind."""
        if self.pending:
            self._read(self.pending)
            self.pending = None

    @staticmethod
    def _read(pending) -> list[int]:
        work, result = pending
        work.wait()
        return result.tolist()


def barrier():
    """Wait for every rank (over the control group; no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier(group=_control)


def leave():
    """Leave the process group.

    A process that exits still in one may abort at interpreter shutdown (gloo's
    threads outlive Python), which torchrun reports as a failed worker.
    """
    global _control
    if dist.is_initialized():
        dist.destroy_process_group()
    _control = None
