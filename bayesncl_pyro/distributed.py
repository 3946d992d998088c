"""Data-parallel training under ``torchrun``: process group, global negatives, rank-0-only side effects.

Why the per-rank loss is the plain ``-ELBO / num_rows`` of the local batch
--------------------------------------------------------------------------
With W ranks of R rows each, rank r's loss is ``L_r = mean over its rows of (InfoNCE_i + lambda KL_i)``
(the rows plate has the global data set size and the local batch, so it scales by num_rows / R), where
InfoNCE_i contrasts against the rows of *all* ranks. The gather's backward sums, onto each rank's
rows, the gradients of every rank's loss; DDP then averages the parameter gradients over ranks. So
the update is ``(1 / W) * grad(sum_r L_r) = grad(mean over all W R rows)``: exactly the gradient of
one process training on the global batch (``tests/test_distributed.py`` checks it).
"""

import os

import torch
import torch.distributed as dist


def local_rank() -> int | None:
    """This process's GPU number among those of its machine under torchrun (LOCAL_RANK), None in a plain run."""
    return int(os.environ.get("LOCAL_RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None


def setup(device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device) for the device ``training.pick_device`` resolved (under torchrun: this
    process's GPU). Makes a GPU the current device of the calling thread, and joins the process group that torchrun
    describes in the environment (nccl on CUDA, gloo on CPU) when WORLD_SIZE > 1; a plain run is rank 0 of 1."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def gather_rows(u: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The ``ContrastiveModel.gather`` hook: this rank's rows (R x K) -> (all ranks' rows in rank order,
    W R x K; the offset of ours). Gradients flow back to the rank that owns each row, so every rank's
    negatives train every encoder. Outside a process group of several ranks: ``(u, 0)``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return u, 0
    from torch.distributed.nn.functional import all_gather  # imports a lot; only DDP runs need it

    return torch.cat(all_gather(u)), dist.get_rank() * u.shape[0]


def all_gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order (a single-process run gets ``[obj]``)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` is set on any rank (a plain run: ``flag``)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor(float(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier():
    if dist.is_initialized():
        dist.barrier()
