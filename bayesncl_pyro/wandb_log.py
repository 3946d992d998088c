"""A run's log as a Weights & Biases run (``--wandb``, ``pip install -e '.[wandb]'``), written by rank 0 beside
``log.jsonl``: what the TensorBoard events get under the same names (every numeric field of each log record as
``train/<field>``, the per-dimension mean inclusion probabilities as a histogram, ``gates/inclusion_per_dim``, and
the evaluation as ``eval/<metric>`` at the last step and in the run's summary), plus the run's config.

The W&B run lives in ``<out>/wandb/``; its id is kept in ``<out>/wandb/run_id``, so a resumed run goes on
logging into the same W&B run. ``WANDB_MODE=offline`` writes it there without a network (``wandb sync`` uploads it
later); ``WANDB_PROJECT`` names the project (default ``bayesncl-pyro``)."""

import os
import uuid
from pathlib import Path

import torch

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.tensorboard_log import INCLUSION, scalars

PROJECT = "bayesncl-pyro"


class WandbLog:
    def __init__(self, run_dir: str | os.PathLike, config: dict):
        try:
            import wandb
        except ImportError:
            raise UserError("--wandb needs the wandb package: pip install -e '.[wandb]' (or pip install wandb), or "
                            "leave --wandb out") from None
        self.wandb = wandb
        folder = Path(run_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=Path(run_dir).name,
                                  id=run_id, resume="allow", dir=str(run_dir), config=config)
        except Exception as e:  # no login in online mode, a server that refuses: say it in one line
            cause = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"--wandb: W&B did not start a run ({cause}); log in with `wandb login`, or export "
                            "WANDB_MODE=offline to write the run into the run folder for a later `wandb sync`") from None
        id_file.write_text(run_id + "\n")

    def record(self, rec: dict, inclusion: torch.Tensor | None = None):
        """One log.jsonl record; ``inclusion``: the K per-dimension mean inclusion probabilities of its step."""
        values = scalars("train", rec)
        if inclusion is not None:
            values[INCLUSION] = self.wandb.Histogram(inclusion.float().cpu().numpy())
        self.run.log(values, step=rec["step"])

    def evaluation(self, results: dict, step: int):
        values = scalars("eval", results)
        self.run.log(values, step=step)
        self.run.summary.update(values)

    def close(self):
        self.run.finish()
        self.wandb.teardown()  # its service writes the last records when it stops: the folder is complete now
