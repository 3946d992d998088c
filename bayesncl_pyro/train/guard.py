"""The training step's divergence guard, decided on the device without a host sync.

Whether each step's loss and gradients are finite is decided on the device; the host reads the verdicts every few steps
(``Trainer``'s checks).

Each optimizer step runs inside ``DivergenceGuard.judge``, which writes one row on the device: ``[not finite, InfoNCE
term, loss, 2-norm of each parameter's gradient]``. The norms are taken in float64, where a float32 gradient's norm
cannot overflow, so a norm is finite exactly when every element of the gradient is. Under DDP the "not finite" flag is
the maximum over the ranks (an all-reduce queued on the device), so every rank judges a step alike. ``bad_steps`` copies
the rows to the host in one transfer and names what went wrong in each bad step.

With ``mask`` (``--on-nan skip``) a bad step's update is undone on the device, as a fused optimizer skips its step on
GradScaler's ``found_inf``: the module buffers its forward pass updates (BatchNorm's running statistics; ``begin``),
the parameters and the optimizer state the step touches are copied first, then put back by ``torch.where`` on the
flag. State the step creates (SGD's and LARS's momentum, AdamW's moments and step count) goes to zero, which is what
their first step starts from (SGD without dampening: ``momentum * 0 + g == g``). The cost, in that mode only: one
more copy of the parameters, the optimizer state and the buffers in memory, kept from step to step, and per step
two fused copies into it (``torch._foreach_copy_``: a few kernels per device and dtype) and one ``torch.where`` per
tensor (PyTorch has no foreach select, and a NaN rules out a select by arithmetic). Without ``mask``
(``--on-nan stop``) a bad step is applied in memory; the trainer checks before writing any checkpoint, so none
holds it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch
import torch.distributed as dist

# the terms of the -ELBO whose gradients reach each part of the learner, by parameter-name prefix (the gating
# head sees h.detach())
TERMS = {"backbone.": "InfoNCE", "head.projector.": "InfoNCE", "head.model.": "KL", "head.guide.rate_guide.": "KL",
         "head.guide.": "InfoNCE or KL"}


class DivergenceGuard:
    """Judges on the device whether each step's loss and gradients are finite; with ``mask``, undoes a bad step.

    Use: ``begin()`` before a step's forward pass; after ``loss.backward()``, ``optimizer.step()`` inside ``with
    judge(loss, nce)``, then ``keep(number)``; ``bad_steps()`` when the host may wait. ``rows``: the most steps between
    two ``bad_steps``.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, mask: bool, rows: int):
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.buffers = list(module.buffers())
        self.optimizer, self.mask, self.capacity = optimizer, mask, rows
        self.rows: torch.Tensor | None = None  # capacity x (3 + parameters), on the device, made at the first step
        self.row: torch.Tensor | None = None  # the last step's
        self.steps: list[int] = []  # the step numbers of the rows written since the last bad_steps
        self.saved_buffers: list[torch.Tensor] = []
        self.copies: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # _copy's: originals, copies

    def begin(self):
        """With ``mask``: keep the buffers as they are before the forward pass updates them."""
        if self.mask:
            self.saved_buffers = self._copy("buffers", self.buffers)

    @contextlib.contextmanager
    def judge(self, loss: torch.Tensor, nce: torch.Tensor):
        """Context manager around a step's optimizer step that computes its verdict on the device.

        The verdict goes to :attr:`row`; with ``mask``, a bad step is undone. Queues work only: nothing here waits for
        the device, and every call queues the same work, so a CUDA graph can capture it; :meth:`keep` then files the
        verdict under the step's number.
        """
        grads = [p.grad for p in self.params if p.grad is not None]
        norms = iter(torch._foreach_norm(grads, 2, dtype=torch.float64) if grads else [])
        zero = loss.new_zeros((), dtype=torch.float64)
        row = torch.stack([zero, nce.detach().double(), loss.detach().double(),
                           *(next(norms) if p.grad is not None else zero for p in self.params)])
        row[0] = (~row[1:].isfinite()).any()
        if dist.is_initialized():
            dist.all_reduce(row[:1], op=dist.ReduceOp.MAX)
        self.row = row
        if not self.mask:
            yield
            return
        ok = row[0] == 0
        with torch.no_grad():
            tensors = self._touched()
            saved = self._copy("step", tensors)
        yield
        self._undo_unless(ok, tensors, saved)

    def keep(self, number: int):
        """File the last verdict as step ``number``'s.

        The verdict is :meth:`judge`'s, kept for :meth:`bad_steps`: a copy on the device into the row of the next unread
        step, which differs from step to step (out of a CUDA graph).
        """
        if len(self.steps) == self.capacity:
            raise RuntimeError(f"DivergenceGuard holds {self.capacity} unread steps; call bad_steps() more often")
        if self.rows is None:
            self.rows = self.row.new_empty(self.capacity, len(self.row))
        self.rows[len(self.steps)] = self.row
        self.steps.append(number)

    def grad_norms(self) -> list[float]:
        """The 2-norm of each parameter's gradient in the last step.

        In ``params``' order (0 where none): one host sync.
        """
        return self.row[3:].tolist()

    def _copy(self, name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of ``tensors`` into memory kept from call to call.

        The memory is allocated at the first call (and again when the tensors change, as when the first step creates the
        optimizer's state), with one fused copy per device and dtype.
        """
        originals, copies = self.copies.get(name, ([], []))
        if len(originals) != len(tensors) or any(a is not b for a, b in zip(originals, tensors)):
            originals, copies = list(tensors), [torch.empty_like(t) for t in tensors]
            self.copies[name] = originals, copies
        groups: dict[tuple, tuple[list, list]] = {}
        for t, c in zip(tensors, copies):
            group = groups.setdefault((t.device, t.dtype), ([], []))
            group[0].append(c)
            group[1].append(t)
        for targets, sources in groups.values():
            torch._foreach_copy_(targets, sources)
        return copies

    @torch.no_grad()
    def _undo_unless(self, ok: torch.Tensor, tensors: list[torch.Tensor], saved: list[torch.Tensor]):
        """Unless ``ok``, put back what the step changed.

        ``tensors`` (as ``saved``), the buffers (as ``begin`` kept them), and the state it made (to zero).
        """
        for t, s in zip(tensors + self.buffers, saved + self.saved_buffers, strict=True):  # strict: begin() was called
            torch.where(ok, t, s, out=t)
        self.saved_buffers = []
        old = {id(t) for t in tensors}
        for t in self._touched():
            if id(t) not in old:  # made by this step
                torch.where(ok, t, torch.zeros((), dtype=t.dtype, device=t.device), out=t)

    def _touched(self) -> list[torch.Tensor]:
        """The parameters an optimizer step changes, and their optimizer state."""
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        state = [v for p in params for v in self.optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
        return params + state

    def bad_steps(self) -> list[tuple[int, str]]:
        """The bad steps since the last call, with what was not finite in each.

        (step number, what was not finite), in order: one host sync (none when no step was taken since).
        """
        if not self.steps:
            return []
        rows = self.rows[:len(self.steps)].tolist()
        steps, self.steps = self.steps, []
        return [(number, self._what(row)) for number, row in zip(steps, rows) if row[0]]

    def _what(self, row: list[float]) -> str:
        """The first non-finite term of a bad step's row: InfoNCE, then KL (loss - InfoNCE), then a gradient."""
        flag, nce, loss, *norms = row
        if not _finite(nce):
            return f"the InfoNCE term is {nce}"
        if not _finite(loss):
            return f"the KL term is {loss - nce}"
        name = next((n for n, norm in zip(self.names, norms) if not _finite(norm)), None)
        if name is None:
            return "a loss or gradient on another process is not finite"
        term = next((t for prefix, t in TERMS.items() if name.startswith(prefix)), "the loss")
        return f"the gradient of {name} (from {term}) is not finite"


def _finite(x: float) -> bool:
    return x - x == 0  # False for nan and +-inf


CHECK_EVERY = 100
"""The most training steps between two reads of the divergence guard's verdicts (it also reads them at every log step,
before every checkpoint and after the last step): the only host syncs of the training loop besides logging, and under
DDP on GPUs, SyncBatchNorm's (one per BatchNorm layer and step: docs/PERFORMANCE.md)."""

class StopRequest:
    """Context manager that turns stop signals into a request honoured at a step boundary.

    Within ``with``: SIGINT, SIGTERM and SIGUSR1 only note the signal, so training stops at a step boundary (the same on
    every rank) with a checkpoint. A second Ctrl-C acts as usual (KeyboardInterrupt), except under torchrun, which
    forwards the terminal's Ctrl-C to workers that got it already; a repeated SIGTERM or SIGUSR1 is the same request (a
    cluster signals the launcher, which forwards it, and the workers). Nested ``with`` blocks share one request: ``fit``
    holds it over training and the final checkpoint.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum, self.previous, self.depth = None, {}, 0

    def __enter__(self):
        if not self.depth:
            self.signum = None
            if threading.current_thread() is threading.main_thread():  # only it may set handlers
                self.previous = {s: signal.signal(s, self._note) for s in self.SIGNALS}
        self.depth += 1
        return self

    def _note(self, signum, frame):
        # no printing here: the handler may interrupt a write to the same stream. Pre-emption outranks Ctrl-C
        # (the larger number, as in the ranks' vote), since it decides the exit status: requeue
        self.signum = max(self.signum or 0, signum)
        if signum == signal.SIGINT and "TORCHELASTIC_RUN_ID" not in os.environ:
            signal.signal(signal.SIGINT, self.previous[signal.SIGINT])

    def __exit__(self, *exc):
        self.depth -= 1
        if not self.depth:
            for s, handler in self.previous.items():
                signal.signal(s, handler)
