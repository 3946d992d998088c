"""Reading what a run wrote: its log, its evaluation in today's terms, its checkpoint (weights-only)."""

import os
import warnings
from pathlib import Path

import torch

from bayesncl_pyro.config import check_extent
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir.layout import DATA_LIMIT, EVAL, LOG, logger
from bayesncl_pyro.rundir.opening import open_file, read_json, read_records


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """The records of a run's ``log.jsonl`` (empty if there is none): :func:`read_records`."""
    return read_records(Path(run_dir) / LOG)


def read_eval(run_dir: str | os.PathLike, gate: str | None = None) -> dict:
    """Return a run's ``eval.json`` (``gate``: the run's gate estimator), in today's terms.

    An earlier version's file reads as today's: the share of gates open at the evaluation mask, which it named
    ``gate_rate`` (the log's name for the mean inclusion probability), as ``gates_open``, and one written before the
    reference protocol existed as ``protocol: fast``.
    """
    path = Path(run_dir) / EVAL
    results = read_json(path)
    if not isinstance(results, dict):
        raise UserError(f"{path} holds a {type(results).__name__}, not an evaluation; it is not what a run writes: "
                        "move it away")
    results.setdefault("protocol", "fast")
    if "gate_rate" in results:
        results["gates_open"] = results.pop("gate_rate")
        # 0.2.0 evaluated gs-reference-kl at q's mode; 0.3 at the reference's mask (0.1's gs, read as
        # gs-reference-kl, was evaluated there already)
        if gate == "gs-reference-kl":
            logger.warning(f"note: {path} evaluated the gs-reference-kl gates at q's mode, not at the reference's "
                           "mask 1[sigmoid(l) > 0.5] as this version does; move it away and rerun the same command to "
                           "evaluate the checkpoint again")
    return results


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint without executing code from it (weights-only unpickling), by the rule of :func:`open_file`."""
    with open_file(path, DATA_LIMIT) as f:
        try:
            with warnings.catch_warnings():  # torch's note on a pickle protocol it did not write: the error says enough
                warnings.simplefilter("ignore")
                state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # any unpickling failure means the file is not a usable checkpoint
            raise UserError(f"cannot read checkpoint {path}: {_load_failure(e)}; it is corrupt or not a "
                            "bayesncl-pyro checkpoint (move it away to start afresh)") from None
    if not isinstance(state, dict) or not {"version", "config", "learner", "channels", "num_train"} <= state.keys() \
            or not isinstance(state["config"], dict):
        raise UserError(f"{path} is not a bayesncl-pyro checkpoint (it lacks the run's config and weights)")
    # a pickle keeps shared references: a kilobyte can hold a list of 2^40 items, which Config.to_dict would copy
    check_extent(state["config"], f"the config in {path}", "a list that holds another many times over",
                 "a run's config holds a few dozen: it is not what a run writes, move it away")
    return state


def _load_failure(e: Exception) -> str:
    """Say what a weights-only ``torch.load`` failed on, without torch's advice to pass ``weights_only=False``.

    That advice runs the code a pickle names: never for a file of unknown origin.
    """
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines or not lines[0].startswith("Weights only load failed"):
        return f"{e.__class__.__name__}: {lines[0] if lines else ''}"
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
    detail = [line.removeprefix("WeightsUnpickler error:").strip() for line in lines
              if not line.startswith(advice) and "weights_only" not in line]
    detail = next((line for line in detail if line), "")
    return "it holds objects other than tensors and plain values" + (f" ({detail.rstrip('.')})" if detail else "")
