"""Where a run's progress and records go, rank 0 only.

``RunLog``, the one logger of a training run, writes each
record to ``log.jsonl``, to TensorBoard events (``--tensorboard``) and a Weights & Biases run (``--wandb``,
``pip install -e '.[wandb]'``), both beside ``log.jsonl``, and to the terminal (a bar, else one line with an
estimate), and shows the progress of other long work (the evaluation: ``reporter``).
"""

import contextlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError, quoted
from bayesncl_pyro.rundir import LOG, WANDB_DIR, append_line, atomic_save, output_folder, read_bytes

logger = logging.getLogger(__name__)

LONG = 30.0
"""Seconds: work estimated to take longer is announced by a line (without a bar); shorter work is not."""

Progress = Callable[[Iterable, int, str, str], Iterator]


def reporter(bar: bool) -> Progress:
    """A ``progress(items, total, what, unit)`` that shows a bar or one line with the time left.

    ``items`` as they come, shown by a tqdm bar on stderr (``bar``), or by
    one line once the first item is done if all ``total`` would take longer than ``LONG``: what, and about how long
    the rest takes.
    """
    def progress(items: Iterable, total: int, what: str, unit: str) -> Iterator:
        if bar:
            from tqdm.auto import tqdm  # late: only a bar needs it

            yield from tqdm(items, total=total, desc=what, unit=unit, leave=False, dynamic_ncols=True)
            return
        start = time.perf_counter()
        for i, item in enumerate(items):
            yield item
            if i == 0 and (took := time.perf_counter() - start) * total > LONG:
                units = unit if total == 1 else unit + ("es" if unit.endswith(("s", "sh", "ch", "x")) else "s")
                logger.info(f"{what}: about {duration(took * (total - 1))} to go ({total} {units}, {took:.2g} s each)")

    return progress


def duration(seconds: float) -> str:
    """``seconds`` in words: "40 s", "4.5 minutes", "3.2 hours", "9.1 days"."""
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 1.5 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


class RunLog:
    """A training run's records and evaluation, to its log file, trackers and terminal.

    ``record`` writes one ``log.jsonl`` line each, in the run folder ``run_dir``; records go to that file, to
    TensorBoard and W&B where ``cfg`` asks for them (the trackers: none without ``trackers``), and to the terminal, as
    the postfix of a tqdm bar on stderr (``bar``) or else printed, the first record followed by an estimate of the time
    left. Within ``training``, ``step()`` after every step: ``images_per_s()`` is the rate of the steps since the last
    record.
    """

    def __init__(self, run_dir: str | os.PathLike, cfg: Config, bar: bool, trackers: bool = True, step: int = 0,
                 rewind: bool = False):
        """``step``: the checkpoint's step a run resumes from; ``rewind``: whether the run logged past it before."""
        self.path, self.batch_size, self.show_bar = Path(run_dir) / LOG, cfg.batch_size, bar
        self.trackers = [] if not trackers else ([TensorBoardLog(run_dir, step)] if cfg.tensorboard else []) + (
            [WandbLog(run_dir, cfg.to_dict(), step + 1 if rewind else None)] if cfg.wandb else [])
        self.bar, self.last_step, self.estimated = None, 0, False
        self.tic, self.seen = time.perf_counter(), 0

    @contextlib.contextmanager
    def training(self, step: int, last_step: int):
        """Around the steps after ``step`` up to ``last_step``: the bar, the clock of ``images_per_s``."""
        if self.show_bar:
            from tqdm.auto import tqdm  # late: only a bar needs it

            self.bar = tqdm(total=last_step, initial=step, unit="step", dynamic_ncols=True)
        self.last_step, self.estimated = last_step, False
        self.tic, self.seen = time.perf_counter(), 0
        try:
            yield
        finally:
            if self.bar is not None:
                self.bar.close()
                self.bar = None

    def step(self):
        """Count one step's images, and advance the bar."""
        self.seen += self.batch_size
        if self.bar is not None:
            self.bar.update(1)

    def images_per_s(self) -> float:
        """Images per second since the last record."""
        return self.seen / (time.perf_counter() - self.tic)

    def record(self, rec: dict, inclusion: torch.Tensor | None = None):
        """One log record; ``inclusion``: the K per-dimension mean inclusion probabilities of its step."""
        self.tic, self.seen = time.perf_counter(), 0
        append_line(json.dumps(rec), self.path)
        for tracker in self.trackers:
            tracker.record(rec, inclusion)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
            return
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()), flush=True)
        if not self.estimated:  # a bar shows the time to go; a log needs a line for it
            self.estimated = True
            left = self.last_step - rec["step"]
            print(f"at {rec['images_per_s']:.4g} images/s, the {left} steps left take about "
                  f"{duration(left * self.batch_size / rec['images_per_s'])}", flush=True)

    def progress(self) -> Progress:
        """The progress of other long work (the evaluation), shown as the training's: by a bar or by a line."""
        return reporter(self.show_bar)

    def evaluation(self, results: dict, step: int):
        """Send the evaluation's results at ``step`` to the trackers."""
        for tracker in self.trackers:
            tracker.evaluation(results, step)

    def close(self):
        """Close the trackers."""
        for tracker in self.trackers:
            tracker.close()


INCLUSION = "gates/inclusion_per_dim"


class TensorBoardLog:
    """A run's records and evaluation as TensorBoard events in its run folder."""
    def __init__(self, run_dir: str | os.PathLike, step: int = 0):
        """Events of the run in ``run_dir`` that resumes from its checkpoint at ``step``."""
        try:
            from torch.utils.tensorboard import SummaryWriter  # late: an optional extra
        except ImportError:  # torch's writer needs the tensorboard package, an optional extra
            raise UserError("--tensorboard needs the tensorboard package: pip install -e '.[tensorboard]' "
                            "(or pip install tensorboard), or leave --tensorboard out") from None
        # a killed run's events past its checkpoint are hidden, as its log.jsonl records are cut (rundir.cut_records)
        self.writer = SummaryWriter(str(run_dir), purge_step=step + 1 if step else None)

    def record(self, rec: dict, inclusion: torch.Tensor | None = None):
        """One log.jsonl record; ``inclusion``: the K per-dimension mean inclusion probabilities of its step."""
        self._scalars("train", rec, rec["step"])
        if inclusion is not None:
            self.writer.add_histogram(INCLUSION, inclusion.float().cpu(), rec["step"])
        self.writer.flush()  # a record at a time, as log.jsonl: TensorBoard shows a run while it trains

    def evaluation(self, results: dict, step: int):
        """Write the evaluation's numeric results at ``step`` under ``eval/``."""
        self._scalars("eval", results, step)
        self.writer.flush()

    def close(self):
        """Close the event file."""
        self.writer.close()

    def _scalars(self, prefix: str, values: dict, step: int):
        for key, value in scalars(prefix, values).items():
            self.writer.add_scalar(key, value, step)


def scalars(prefix: str, values: dict) -> dict:
    """The numeric fields of a log record or an eval dict, tagged ``<prefix>/<field>``.

    Not bool, str or lists; not ``step``. These are the tags that every logger of a run gives them.
    """
    return {f"{prefix}/{k}": v for k, v in values.items() if k != "step" and type(v) in (int, float)}


PROJECT = "bayesncl-pyro"


class WandbLog:
    """A run's records, evaluation and config logged to a Weights & Biases run.

    A run resumed after it logged past its checkpoint (killed, not stopped) rewinds its W&B run to the step after the
    checkpoint (``rewind``; W&B's ``resume_from="ID?_step=N"`` keeps the history before step N), as its log.jsonl is
    cut and TensorBoard purges its events: otherwise W&B keeps the killed run's records of the steps logged again and
    drops the resumed run's (its steps must grow). Rewinding is a preview of W&B's servers: one that refuses it gets
    the run resumed as before, with a note. A run stopped at a checkpoint logged nothing past it and resumes plainly.
    """
    def __init__(self, run_dir: str | os.PathLike, config: dict, rewind: int | None = None):
        try:
            import wandb  # late: an optional extra
        except ImportError:
            raise UserError("--wandb needs the wandb package: pip install -e '.[wandb]' (or pip install wandb), or "
                            "leave --wandb out") from None
        self.wandb = wandb
        hidden = Path(run_dir) / ".wandb"  # W&B writes its run there, not into wandb/, where the name exists
        if os.path.lexists(hidden):
            raise UserError(f"{hidden} is not what a run writes, and W&B would write its run into it (it may be a "
                            f"link to anywhere) rather than into {Path(run_dir) / WANDB_DIR}: move it away")
        id_file = output_folder(Path(run_dir) / WANDB_DIR) / "run_id"
        existed = id_file.exists()
        run_id = read_bytes(id_file, 64).decode(errors="replace").strip() if existed else uuid.uuid4().hex[:8]
        if not re.fullmatch(r"[A-Za-z0-9_-]+", run_id):  # refused by W&B, whose message would ask for a login
            raise UserError(f"{id_file} holds {quoted(run_id)}, not a W&B run id (letters, digits, - and _, as a run "
                            "writes it); it is not what a run writes: move it away, and a new W&B run starts")
        start = dict(project=os.environ.get("WANDB_PROJECT", PROJECT), name=Path(run_dir).name, id=run_id,
                     dir=str(run_dir), config=config)
        try:
            self.run = None
            if rewind is not None and existed:  # resume and resume_from exclude each other
                try:
                    self.run = wandb.init(**start, resume_from=f"{run_id}?_step={rewind}")
                except Exception as e:
                    logger.warning(f"note: W&B did not rewind run {run_id} to step {rewind} ({_first_line(e)}); it "
                                   f"keeps the records that the killed run logged from step {rewind} on, and drops "
                                   f"the resumed run's records of those steps (log.jsonl holds them)")
            if self.run is None:
                self.run = wandb.init(**start, resume="allow")
        except Exception as e:  # no login in online mode, a server that refuses: say it in one line
            raise UserError(f"--wandb: W&B did not start a run ({_first_line(e)}); log in with `wandb login`, or "
                            "export WANDB_MODE=offline to write the run into the run folder for a later `wandb sync`"
                            ) from None
        atomic_save(f"{run_id}\n".encode(), id_file)

    def record(self, rec: dict, inclusion: torch.Tensor | None = None):
        """One log.jsonl record; ``inclusion``: the K per-dimension mean inclusion probabilities of its step."""
        values = scalars("train", rec)
        if inclusion is not None:
            values[INCLUSION] = self.wandb.Histogram(inclusion.float().cpu().numpy())
        self.run.log(values, step=rec["step"])

    def evaluation(self, results: dict, step: int):
        """Log the evaluation's numeric results at ``step`` under ``eval/``."""
        values = scalars("eval", results)
        self.run.log(values, step=step)
        self.run.summary.update(values)

    def close(self):
        """Finish the W&B run and stop its service."""
        self.run.finish()
        self.wandb.teardown()  # its service writes the last records when it stops: the folder is complete now


def _first_line(e: Exception) -> str:
    """The first line of ``e``'s message, or its class's name."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__
