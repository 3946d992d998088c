"""A run's log as TensorBoard events (``--tensorboard``), written by rank 0 into the run folder beside
``log.jsonl``: every numeric field of each log record (tag ``train/<field>``), the mean inclusion probability
of each of the K gates as a histogram over the dimensions (``gates/inclusion_per_dim``), and the final
evaluation (``eval/<metric>``, at the last step). ``tensorboard --logdir runs/`` shows every run below it."""

import os

import torch

from bayesncl_pyro.errors import UserError

INCLUSION = "gates/inclusion_per_dim"


class TensorBoardLog:
    def __init__(self, run_dir: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package, an optional extra
            raise UserError("--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]' "
                            "(or pip install tensorboard), or leave --tensorboard out") from None
        self.writer = SummaryWriter(str(run_dir))

    def record(self, rec: dict, inclusion: torch.Tensor | None = None):
        """One log.jsonl record; ``inclusion``: the K per-dimension mean inclusion probabilities of its step."""
        self._scalars("train", rec, rec["step"])
        if inclusion is not None:
            self.writer.add_histogram(INCLUSION, inclusion.float().cpu(), rec["step"])
        self.writer.flush()  # a record at a time, as log.jsonl: TensorBoard shows a run while it trains

    def evaluation(self, results: dict, step: int):
        self._scalars("eval", results, step)
        self.writer.flush()

    def close(self):
        self.writer.close()

    def _scalars(self, prefix: str, values: dict, step: int):
        for key, value in scalars(prefix, values).items():
            self.writer.add_scalar(key, value, step)


def scalars(prefix: str, values: dict) -> dict:
    """The numeric fields of a log record or an eval dict (not bool, str or lists; not ``step``), as
    ``{"<prefix>/<field>": value}``: the tags that every logger of a run gives them."""
    return {f"{prefix}/{k}": v for k, v in values.items() if k != "step" and type(v) in (int, float)}
