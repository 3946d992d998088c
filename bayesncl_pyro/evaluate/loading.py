"""A run folder's trained learner: the one place that turns a run's ``checkpoint.pt`` into a model.

``rundir`` reads the file (a weights-only unpickling, by the run folder's rule) and says which code the run's
configuration names (``check_code``); here the learner is rebuilt from the saved config, with its data folder chosen
by the rule below. ``load_run`` (``evaluate/run.py``) wraps the learner as an object for notebooks; the trainer resumes
its own run (``train/trainer.py``), with the optimizer's state migrated by ``nn/optim.py``. This module sits below
``evaluate/posterior.py``, which opens a run folder here, and ``run.py`` sits above it (``TrainedRun.posterior``).
"""

import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from bayesncl_pyro.config import Config
from bayesncl_pyro.data.datasets import FOLDER_DATASETS
from bayesncl_pyro.device import pick_device
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.learner import ContrastiveLearner, load_weights
from bayesncl_pyro.rundir import CHECKPOINT, RunFolder, check_code, run_folder

logger = logging.getLogger(__name__)


def load_learner(run_dir: str | os.PathLike, device: str | torch.device = "cpu", *, trust_code: bool = False,
                 data_dir: str | os.PathLike | None = None) -> tuple[ContrastiveLearner, Config]:
    """Load the trained learner of a run folder (or of its ``checkpoint.pt``) and its config.

    The learner is in eval mode on ``device`` (``cpu``, ``cuda``, ``cuda:N`` or ``auto``, as ``--device``), for
    notebooks and evaluation.

    A run folder is data, perhaps a colleague's: an encoder or prior of its config that is code
    (``package.module:name``) is refused unless ``trust_code``, and the config's ``data_dir`` is ``data_dir`` when
    given, else the run's own if it is absolute and outside the run folder (else None: loading the run's data then
    asks for ``--data-dir``).
    """
    folder = run_folder(run_dir)
    path = folder / CHECKPOINT
    with RunFolder.open(folder) as run:  # where it is checked is where it is read
        if not run.exists(CHECKPOINT):
            raise UserError(f"{run_dir} holds no {CHECKPOINT}; point at a run folder written by run_svi.py")
        device = pick_device(str(device), flag="device")
        state = run.load_checkpoint()
    cfg = Config.from_dict(state["config"])
    check_code(cfg, path, trust_code)
    cfg = replace(cfg, data_dir=str(data_dir) if data_dir is not None else _own_data_dir(cfg, folder, path))
    learner = ContrastiveLearner(cfg, state["channels"], state["num_train"])
    load_weights(learner, state, path)
    return learner.to(device).eval(), cfg


def _own_data_dir(cfg: Config, folder: Path, path: Path) -> str | None:
    """Return the run's own data folder when it may be read, else None (said in a note).

    It may be read when it is an absolute path outside the run folder (the same data on a shared file system); a
    relative one depends on where the command runs, and one in the run folder is the sender's.
    """
    if cfg.data_dir is None or cfg.dataset not in FOLDER_DATASETS:
        return cfg.data_dir
    saved = Path(cfg.data_dir)
    real, run = saved.resolve(), folder.resolve()
    why = "is relative" if not saved.is_absolute() else \
        "is the run folder or lies in it" if real == run or run in real.parents else \
        "holds the run folder" if real in run.parents else None
    if why:
        logger.warning(f"note: {path} names the data folder {cfg.data_dir!r}, which {why}; a run's data folder is "
                       "read only from an absolute path outside the run: name it with --data-dir (data_dir= in Python)")
        return None
    return cfg.data_dir
