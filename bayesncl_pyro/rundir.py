"""A run folder: claiming it, moving an earlier run aside, atomic writes, and reading back what a run wrote.

    config.json     the resolved Config (what was actually run)
    checkpoint.pt   state_dicts, optimizer, scheduler, RNG states, step; replaced atomically
    log.jsonl       one JSON object every ``log_every`` steps (with ``warnings`` when the gates degenerate)
    conflict.jsonl  the per-dimension InfoNCE gradient conflict every ``conflict_every`` steps (diagnostics.py)
    eval.json       the evaluation of the final model
    gates.nc        BayesNCL only: the gate posterior on the test split, as ArviZ data (arviz_export.py)
    bad_images.txt  with --skip-bad-images: the unreadable files that were skipped, one per line
    run.lock        locked (flock) by the process training in the folder, whose pid it holds

Nothing here deletes a user's file: an earlier run is moved into a ``previous-<time>`` subfolder, a folder that
holds anything else is refused, and every file is replaced by a rename, so a crash mid-write leaves the previous
version intact (its temporary file, named by the writing process, is removed by the next run in the folder).

A run folder is data: reading one (``infer.learner.load_learner``) imports no code that its configuration names
unless asked to (``trust_code``, :func:`check_code`), and reads its data folder only from an absolute path outside the
run folder.
"""

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path

import torch

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.plugins import TIMM, is_spec

CONFIG = "config.json"
CHECKPOINT = "checkpoint.pt"
LOG = "log.jsonl"
EVAL = "eval.json"
GATES_FILE = "gates.nc"
BAD_IMAGES = "bad_images.txt"
PREVIOUS = "previous-"  # prefix of the subfolders that --overwrite moves earlier runs into
LOCK = "run.lock"
_REWRITTEN = (CHECKPOINT, CONFIG, EVAL)  # the files a run replaces (atomic_save): a killed one leaves their .tmp


def claim(out: Path, cfg: Config, overwrite: bool) -> "RunLock | None":
    """Create the run folder ``out`` for ``cfg``, or check that the one there holds this very run; with
    ``overwrite`` move the run it holds aside first. Returns the folder's lock, to be held for the life of the run.

    Refused: ``out`` being the working folder or the data folder or holding either, a folder held by another
    running process, and one that holds files but no run of ours (with ``overwrite`` too). A run there that
    differs from ``cfg`` but never wrote a checkpoint (it was refused or diverged at its first steps) is moved
    aside: it holds nothing to resume. Writes no file of the run: the trainer writes ``config.json`` once the run
    is set up, so that a run refused before it trains (a batch larger than the data set) leaves nothing that would
    refuse the corrected command."""
    _check_place(out, cfg.data_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output folder {out}: {e.strerror}; choose another --out")
    saved = out / CONFIG
    theirs = [p.name for p in sorted(out.iterdir())
              if p.name != LOCK and not p.name.startswith(PREVIOUS) and not _temporary(p.name)]
    if theirs and not _holds_a_run(saved):  # checked before the lock file is made: a user's folder stays as it is
        shown = ", ".join(theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
        raise UserError(f"{out} holds files that are not a bayesncl-pyro run ({shown}); pass a new or empty --out "
                        "(--overwrite moves only an earlier run's files aside)")
    held = lock(out)
    _remove_temporaries(out)
    if overwrite:
        move_aside(out)
    else:
        what = differences(out, cfg)
        if what and not (out / CHECKPOINT).exists():
            print(f"note: {out} holds a run with a different configuration ({what}) that wrote no checkpoint",
                  file=sys.stderr)
            move_aside(out)
        elif what:
            raise UserError(f"{out} holds a run with a different configuration ({what}); "
                            "rerun with the same flags to resume it, pass --overwrite to move it aside "
                            "and start afresh, or pass another --out")
    return held


def differences(folder: Path, cfg: Config) -> str | None:
    """How the run whose configuration ``folder`` holds differs from ``cfg`` (``Config.differences``: "" for this very
    run), None if it holds none; one that cannot be read is a UserError, never taken for another run."""
    saved = folder / CONFIG
    if not saved.exists():
        return None
    try:
        old = Config.from_dict(json.loads(saved.read_text()))
    except (ValueError, TypeError):
        raise UserError(f"{saved} is not a readable run configuration; pass --overwrite to move the "
                        "folder's files aside and start afresh, or pass another --out") from None
    return old.differences(cfg)


def _check_place(out: Path, data_dir: str | None):
    """Refuse an ``out`` that is the working folder or the data folder, or a folder above one of them: moving its
    files aside (--overwrite) would move the user's repository or data set."""
    real = out.expanduser().resolve()
    for what, place in (("the working folder", Path.cwd()), ("the data folder", data_dir)):
        if place is None:
            continue
        place = Path(place).expanduser().resolve()
        if real == place or real in place.parents:
            where = what if real == place else f"a folder above {what} ({place})"
            raise UserError(f"--out {out} is {where}; a run needs a folder of its own: pass e.g. --out runs/NAME")


def _holds_a_run(saved: Path) -> bool:
    """Whether ``saved`` is the config.json of a run of ours (of this version or another)."""
    try:
        values = json.loads(saved.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(values, dict) and "dataset" in values


def _temporary(name: str) -> bool:
    """Whether ``name`` is the temporary file of a run's write (``atomic_save``)."""
    return name.endswith(".tmp") and name.startswith(tuple(f"{n}." for n in _REWRITTEN))


def _remove_temporaries(out: Path):
    """The temporary files that runs killed mid-write (SIGKILL) left: with the folder locked, no one writes them."""
    for tmp in out.iterdir():
        if _temporary(tmp.name):
            with contextlib.suppress(OSError):
                tmp.unlink()


class RunLock:
    """An exclusive ``flock`` on ``OUT/run.lock``, held while this object lives (the trainer's: the run's life, or
    until its process ends, whatever kills it). The file holds the holder's pid, for the next run's message."""

    def __init__(self, out: Path):
        path = out / LOCK
        self.file = open(path, "a+")  # (a lock file is never replaced, so a lock always guards the same file)
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            self.file.seek(0)
            holder = self.file.read().strip() or "another process"
            self.file.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"cannot lock {path}: {e.strerror}; choose another --out") from None
            raise UserError(f"{out} is in use by another run ({holder}); wait for it to end, or pass another "
                            "--out") from None
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()


_HELD: "weakref.WeakValueDictionary[Path, RunLock]" = weakref.WeakValueDictionary()


def _forget_locks():
    """In a forked child (a loader worker): close its copy of the lock files. The parent's lock stays (it goes when
    every copy is closed), and no longer outlives the parent in a worker left behind by a SIGKILL."""
    for held in list(_HELD.values()):
        held.file.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks)


def lock(out: Path) -> RunLock | None:
    """The lock of run folder ``out``: taken, or the one this process holds already (a second Trainer in one
    process resumes there, as a rerun would); None where the lock file cannot be written (a read-only folder:
    the first write of the run says so)."""
    key = out.resolve()
    held = _HELD.get(key)
    if held is None:
        try:
            held = RunLock(out)
        except OSError as e:  # from opening the lock file
            if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                return None
            raise UserError(cannot_write(out / LOCK, e)) from None
        _HELD[key] = held
    return held


def move_aside(out: Path):
    """Move every file of the run folder (but its lock and earlier ``previous-*`` folders) into a new
    ``previous-<time>`` subfolder: restarting never deletes results."""
    old = [p for p in out.iterdir() if not p.name.startswith(PREVIOUS) and p.name != LOCK]
    if not old:
        return
    try:
        aside = Path(tempfile.mkdtemp(prefix=f"{PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}-", dir=out))
        for p in old:
            p.rename(aside / p.name)
    except OSError as e:
        raise UserError(f"cannot move the previous run aside in {out}: {e.strerror}; "
                        "choose another --out") from None
    print(f"moved the previous run's files in {out} to {aside}", file=sys.stderr)


# -- writing ------------------------------------------------------------------------------------


def atomic_save(obj, path: Path):
    """``torch.save(obj)``, or ``obj`` itself if it is bytes, to a temporary file of this process in the same
    folder, fsync, then rename: a crash mid-write leaves the previous file intact. A failed write (disk full,
    read-only) raises ``UserError``; any failure, an interrupt too, removes the temporary file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two writers never share one
    try:
        with open(tmp, "wb") as f:
            if isinstance(obj, bytes):
                f.write(obj)
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # on a read-only file system removing it fails too, and would hide e
            tmp.unlink(missing_ok=True)
        # torch.save's zip writer fails on closing after a failed or interrupted write, with a RuntimeError
        # ("unexpected pos") that would hide the cause: a full disk, a Ctrl-C
        cause = e.__context__ if isinstance(e, RuntimeError) and e.__context__ is not None else e
        if isinstance(cause, OSError):
            raise UserError(f"{cannot_write(path, cause)} (any previous {path.name} is unchanged)") from None
        if isinstance(cause, KeyboardInterrupt):
            raise cause from None
        raise


def write_json(obj, path: Path):
    atomic_save(json.dumps(obj, indent=2).encode() + b"\n", path)


def append_line(line: str, path: Path):
    """Append one line (opened and closed each time: nothing lost to a buffer on a crash)."""
    try:
        with open(path, "a") as f:
            f.write(line + "\n")
    except OSError as e:  # also from the close, which flushes
        raise UserError(cannot_write(path, e)) from None


def cannot_write(path: Path, e: OSError) -> str:
    fix = "choose another --out, in a folder you can write" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) \
        else "free some space or choose another --out"
    return f"cannot write {path}: {e.strerror or e}; {fix}"


# -- reading ------------------------------------------------------------------------------------


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """The records of a run's ``log.jsonl`` (empty if there is none)."""
    path = Path(run_dir) / LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def read_eval(run_dir: str | os.PathLike, gate: str | None = None) -> dict:
    """A run's ``eval.json`` (``gate``: the run's gate estimator). An earlier version's reads in today's terms: the
    share of gates open at the evaluation mask, which it named ``gate_rate`` (the log's name for the mean inclusion
    probability), as ``gates_open``, and one written before the reference protocol existed as ``protocol: fast``."""
    results = json.loads((Path(run_dir) / EVAL).read_text())
    results.setdefault("protocol", "fast")
    if "gate_rate" in results:
        results["gates_open"] = results.pop("gate_rate")
        # 0.2.0 evaluated gs-reference-kl at q's mode; 0.3 at the reference's mask (0.1's gs, read as
        # gs-reference-kl, was evaluated there already)
        if gate == "gs-reference-kl":
            print(f"note: {Path(run_dir) / EVAL} evaluated the gs-reference-kl gates at q's mode, not at the "
                  "reference's mask 1[sigmoid(l) > 0.5] as this version does; move it away and rerun the same "
                  "command to evaluate the checkpoint again", file=sys.stderr)
    return results


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint without executing code from it (weights-only unpickling)."""
    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol it did not write: the error says enough
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means the file is not a usable checkpoint
        raise UserError(f"cannot read checkpoint {path}: {_load_failure(e)}; it is corrupt or not a bayesncl-pyro "
                        "checkpoint (move it away to start afresh)") from None
    if not isinstance(state, dict) or not {"version", "config", "learner", "channels", "num_train"} <= state.keys():
        raise UserError(f"{path} is not a bayesncl-pyro checkpoint (it lacks the run's config and weights)")
    if "optimizer" in state:
        _rescale_prior_group(state)
    return state


def _load_failure(e: Exception) -> str:
    """What a weights-only ``torch.load`` failed on, without torch's advice to load the file with
    ``weights_only=False`` (which runs the code a pickle names: never for a file of unknown origin)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines or not lines[0].startswith("Weights only load failed"):
        return f"{e.__class__.__name__}: {lines[0] if lines else ''}"
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
    detail = [line.removeprefix("WeightsUnpickler error:").strip() for line in lines
              if not line.startswith(advice) and "weights_only" not in line]
    detail = next((line for line in detail if line), "")
    return "it holds objects other than tensors and plain values" + (f" ({detail.rstrip('.')})" if detail else "")


def _rescale_prior_group(state: dict):
    """A checkpoint written before the head divided the prior's gradients by lambda (its ``prior`` optimizer group
    has no ``grad_scale``) trained that group on raw gradients at lr gate_lr / lambda (SGD, LARS) or gate_lr (AdamW).
    Its optimizer and scheduler state are put in the current units, so that the resumed run takes the steps the
    old one would have taken."""
    lam, optimizer = state["config"]["kl_weight"], state["optimizer"]
    for i, group in enumerate(optimizer["param_groups"]):
        if group.get("name") != "prior" or "grad_scale" in group:
            continue
        group["grad_scale"] = 1.0 / lam
        moments = [optimizer["state"][p] for p in group["params"] if p in optimizer["state"]]
        if state["config"]["optimizer"] == "adamw":  # scale-free: its moments take the new gradients' scale
            for m in moments:
                m["exp_avg"], m["exp_avg_sq"] = m["exp_avg"] / lam, m["exp_avg_sq"] / lam**2
            continue
        for key in ("lr", "initial_lr"):
            group[key] = group[key] * lam
        for m in moments:
            if m.get("momentum_buffer") is not None:
                m["momentum_buffer"] = m["momentum_buffer"] / lam
        for key in ("base_lrs", "_last_lr"):
            if key in state["scheduler"]:
                state["scheduler"][key][i] = state["scheduler"][key][i] * lam


def run_folder(run: str | os.PathLike) -> Path:
    """The run folder that ``run`` names: the folder itself, or its ``checkpoint.pt``."""
    run = Path(run)
    return run.parent if run.name == CHECKPOINT and run.is_file() else run


def code_references(cfg: Config) -> dict[str, str]:
    """The settings of ``cfg`` that name code to import (``package.module:name``): setting -> reference."""
    return {flag: spec for flag, spec in (("encoder", cfg.encoder), ("prior", cfg.prior))
            if is_spec(spec) and not spec.startswith(TIMM)}


def check_code(cfg: Config, path: Path, trust: bool):
    """Refuse (or, trusted, announce) the modules that the encoder and prior of the run at ``path`` would import."""
    code = code_references(cfg)
    if not code:
        return
    named = ", ".join(f"{flag} {spec} (module {spec.partition(':')[0]})" for flag, spec in code.items())
    if not trust:
        raise UserError(f"{path} names code that opening it would import and run: {named}; open it with "
                        "--trust-run (trust_code=True in Python) only if you trust whoever wrote the run")
    print(f"note: trusting {path}: importing its {named}", file=sys.stderr)
