"""A run folder: claiming it, moving an earlier run aside, atomic writes, and reading back what a run wrote.

    config.json     the resolved Config (what was actually run)
    checkpoint.pt   state_dicts, optimizer, scheduler, RNG states, step; replaced atomically
    log.jsonl       one JSON object every ``log_every`` steps (with ``warnings`` when the gates degenerate)
    conflict.jsonl  the per-dimension InfoNCE gradient conflict every ``conflict_every`` steps (diagnostics.py)
    eval.json       the evaluation of the final model
    gates.nc        BayesNCL only: the gate posterior on the test split, as ArviZ data (arviz_export.py)
    bad_images.txt  with --skip-bad-images: the unreadable files that were skipped, one per line

Nothing here deletes a file: an earlier run is moved into a ``previous-<time>`` subfolder, and every file
is replaced by a rename, so a crash mid-write leaves the previous version intact.
"""

import contextlib
import errno
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bayesncl_pyro import __version__
from bayesncl_pyro.config import Config
from bayesncl_pyro.device import pick_device
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.learner import ContrastiveLearner

CONFIG = "config.json"
CHECKPOINT = "checkpoint.pt"
LOG = "log.jsonl"
EVAL = "eval.json"
GATES_FILE = "gates.nc"
BAD_IMAGES = "bad_images.txt"
PREVIOUS = "previous-"  # prefix of the subfolders that --overwrite moves earlier runs into


def claim(out: Path, cfg: Config, overwrite: bool):
    """Create the run folder ``out`` for ``cfg``, or check that the one there holds this very run; with
    ``overwrite`` move whatever it holds aside first. Writes nothing: the trainer writes ``config.json`` once the
    run is set up, so that a run refused before it trains (a batch larger than the data set) leaves nothing that
    would refuse the corrected command."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output folder {out}: {e.strerror}; choose another --out")
    saved = out / CONFIG
    if overwrite:
        move_aside(out)
    elif saved.exists():
        try:
            old = Config.from_dict(json.loads(saved.read_text()))
        except (ValueError, TypeError):
            raise UserError(f"{saved} is not a readable run configuration; pass --overwrite to move the "
                            "folder's files aside and start afresh, or pass another --out") from None
        what = old.differences(cfg)
        if what:
            raise UserError(f"{out} holds a run with a different configuration ({what}); "
                            "rerun with the same flags to resume it, pass --overwrite to move it aside "
                            "and start afresh, or pass another --out")


def move_aside(out: Path):
    """Move every file of the run folder (but earlier ``previous-*`` folders) into a new
    ``previous-<time>`` subfolder: restarting never deletes results."""
    old = [p for p in out.iterdir() if not p.name.startswith(PREVIOUS)]
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
    """``torch.save(obj)``, or ``obj`` itself if it is bytes, to a temporary file in the same folder,
    fsync, then rename: a crash mid-write leaves the previous file intact. A failed write (disk full,
    read-only) raises ``UserError`` and leaves no temporary file behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            if isinstance(obj, bytes):
                f.write(obj)
            else:
                torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):  # on a read-only file system removing it fails too, and would hide e
            tmp.unlink(missing_ok=True)
        raise UserError(f"{cannot_write(path, e)} (any previous {path.name} is unchanged)") from None
    except RuntimeError as e:  # torch.save's zip writer, interrupted (a second Ctrl-C), fails on closing: say so
        if isinstance(e.__context__, KeyboardInterrupt):
            raise e.__context__ from None
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
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means the file is not a usable checkpoint
        raise UserError(f"cannot read checkpoint {path}: {e.__class__.__name__}: {str(e).splitlines()[0]}; "
                        "it is corrupt or not a bayesncl-pyro checkpoint (move it away to start afresh)")
    if not isinstance(state, dict) or not {"version", "config", "learner", "channels", "num_train"} <= state.keys():
        raise UserError(f"{path} is not a bayesncl-pyro checkpoint (it lacks the run's config and weights)")
    if "optimizer" in state:
        _rescale_prior_group(state)
    return state


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


# bayesncl-pyro 0.1 named the learner's parts encoder.{backbone,projector}, model and guide; the head holds the
# projector, model and guide since 0.2
_RENAMED = (("encoder.backbone.", "backbone."), ("encoder.projector.", "head.projector."), ("model.", "head.model."),
            ("guide.", "head.guide."))


def load_weights(learner: ContrastiveLearner, state: dict, path: Path):
    """Load a checkpoint's weights (a 0.1 checkpoint's under their current names), explaining a mismatch (another
    version's model) in one line instead of torch's state_dict error."""
    mine, theirs = learner.state_dict(), state["learner"]
    if any(k.startswith("encoder.") for k in theirs):
        theirs = {next((new + k[len(old):] for old, new in _RENAMED if k.startswith(old)), k): v
                  for k, v in theirs.items()}
    problems = [f"{k} is {tuple(theirs[k].shape)} there but {tuple(v.shape)} here"
                for k, v in mine.items() if k in theirs and theirs[k].shape != v.shape]
    problems += [f"{k} missing" for k in mine if k not in theirs]
    problems += [f"{k} unexpected" for k in theirs if k not in mine]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise UserError(f"{path} (bayesncl-pyro {state['version']}) does not fit the model of bayesncl-pyro "
                        f"{__version__}: {'; '.join(problems[:3])}{more}; load it with the version that wrote it")
    learner.load_state_dict(theirs)


def run_folder(run: str | os.PathLike) -> Path:
    """The run folder that ``run`` names: the folder itself, or its ``checkpoint.pt``."""
    run = Path(run)
    return run.parent if run.name == CHECKPOINT and run.is_file() else run


def load_learner(run_dir: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[ContrastiveLearner, Config]:
    """The trained learner of a run folder (or of its ``checkpoint.pt``), for notebooks and evaluation, in eval mode
    on ``device`` (``cpu``, ``cuda``, ``cuda:N`` or ``auto``, as ``--device``)."""
    path = run_folder(run_dir) / CHECKPOINT
    if not path.exists():
        raise UserError(f"{run_dir} holds no {CHECKPOINT}; point at a run folder written by run_svi.py")
    device = pick_device(str(device), flag="device")
    state = load_checkpoint(path)
    cfg = Config.from_dict(state["config"])
    learner = ContrastiveLearner(cfg, state["channels"], state["num_train"])
    load_weights(learner, state, path)
    return learner.to(device).eval(), cfg
