"""The training device: the one check of a ``--device`` name and its one resolution.

The name resolves to a ``torch.device`` for the trainer and for everything that loads a run
(``evaluate.loading.load_learner``, ``load_run``).
"""

import re

import torch

from bayesncl_pyro import distributed
from bayesncl_pyro.errors import UserError, quoted

MAX_INDEX = 127  # torch numbers a device in 8 bits: cuda:128 is read as cuda:-128, larger numbers wrap or fail


def check_device(name: str, said: str = ""):
    """A device as ``--device`` takes it: auto, cpu, cuda or cuda:N (``said``: how the error names it)."""
    said = said or f"--device {quoted(name)[1:-1] if isinstance(name, str) else quoted(name)}"
    if not (isinstance(name, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", name)):
        raise UserError(f"unknown {said}; choose one of: auto, cpu, cuda, cuda:N (GPU number N)")
    if name.startswith("cuda:") and int(name[5:]) > MAX_INDEX:
        raise UserError(f"{said}: no GPU has that number (torch numbers them 0 to {MAX_INDEX}); pass cuda or cuda:N "
                        "for one of this machine's GPUs")


def pick_device(name: str, flag: str = "--device") -> torch.device:
    """The training device that ``--device`` names, resolved once for everything that runs on it.

    The CPU, or
    ``cuda:<index>``. A CUDA device always carries its index, since what selects a GPU by index (``set_device`` in the
    input pipeline's thread, torchvision's decoder) refuses a bare ``cuda``. ``auto``: a GPU if PyTorch sees one, else
    the CPU; ``cuda``: the current GPU, or under ``torchrun`` this process's (``LOCAL_RANK``); ``cuda:N``: GPU N.
    """
    # a flag, or load_run's argument
    said = f"{flag} {quoted(name)[1:-1]}" if flag.startswith("--") else f"{flag}={quoted(name)}"
    check_device(name, said)
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    device = torch.device("cuda" if name == "auto" else name)
    if not torch.cuda.is_available():
        raise UserError(f"{said} was asked for but PyTorch sees no CUDA GPU; use cpu or auto")
    local = distributed.local_rank()
    if device.index is not None and local is not None:
        raise UserError(f"{said} names one GPU, but torchrun starts one process per GPU, each on "
                        "cuda:LOCAL_RANK; pass --device cuda")
    index = device.index if device.index is not None else local if local is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise UserError(f"{said}: PyTorch sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}; pick one "
                        "of those (CUDA_VISIBLE_DEVICES numbers the visible GPUs from 0)")
    return torch.device("cuda", index)
