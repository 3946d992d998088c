"""compare.py's --budget-minutes: the most epochs that fit a time budget, from a few timed steps of each method."""

import contextlib
import io
import math
import statistics
import tempfile
import time
from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.heldout import evaluate
from bayesncl_pyro.train.trainer import Trainer

# steps each method is timed for, the first ones (loader start, kernel autotuning) not counted; the share of the
# budget planned for, the rest kept for what the plan misses (each run's first steps, checkpoints, the conflict
# diagnostics)
TIMING_STEPS, TIMING_SKIP, BUDGET_USE = 25, 5, 0.9


def budget_epochs(left_s: float, fixed_s: float, epoch_s: float, max_epochs: int, budget_minutes: float) -> int:
    """The most epochs that fit the time left.

    At most ``max_epochs``, whose training, ``epoch_s`` seconds each, fits ``BUDGET_USE`` of ``left_s`` seconds besides
    ``fixed_s`` (building and evaluating the runs); a UserError if not one does.
    """
    epochs = min(max_epochs, math.floor((BUDGET_USE * left_s - fixed_s) / epoch_s))
    if epochs < 1:
        raise UserError(f"--budget-minutes {budget_minutes:g} is too short: one epoch of every run takes "
                        f"{epoch_s / 60:.1f} min and building and evaluating them {fixed_s / 60:.1f} min, with "
                        f"{left_s / 60:.1f} min left after timing; raise it, or train on fewer images (--train-subset)")
    return epochs


def plan_budget(budget_minutes: float, max_epochs: int, shared: dict, configs: dict[str, dict], seeds: list[int],
                out: Path, started: float) -> dict:
    """Time each method's steps and choose the epochs that fit the budget.

    Time a few training steps of each method (``configs``: run name -> its Config fields besides ``shared``) and one
    evaluation, then choose the epochs that fit what is left of ``budget_minutes`` since ``started`` (a
    ``time.perf_counter()``) for every run at every seed (``budget_epochs``), at most ``max_epochs``. The plan is kept
    in <out>/budget.json and reused by a rerun with the same settings, so that its runs keep their configuration.
    """
    key = dict(budget_minutes=budget_minutes, max_epochs=max_epochs, runs=list(configs), seeds=seeds,
               shared={k: v for k, v in shared.items() if k not in ("epochs", "warmup_epochs")})
    path = out / "budget.json"
    plan = rundir.read_json(path) if path.exists() else None
    if isinstance(plan, dict) and plan.get("key") == key:
        print(f"reusing the plan in {path}: {plan['epochs']} epochs", flush=True)
        return plan
    step_s, build_s, eval_s = {}, {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for name, fields in configs.items():
            print(f"== timing {name}: {TIMING_STEPS} steps", flush=True)
            tic = time.perf_counter()
            # the schedule does not change a step's time: no warm-up, which might outlast --epochs
            cfg = Config(**{**shared, **fields, "seed": seeds[0], "out": f"{tmp}/{name}", "epochs": max_epochs,
                            "warmup_epochs": 0, "max_steps": TIMING_STEPS, "log_every": 1, "ckpt_every": 10**9})
            with contextlib.redirect_stdout(io.StringIO()):  # one log line per step
                trainer = Trainer(cfg, progress=False)
                build_s[name] = time.perf_counter() - tic
                trainer.train(TIMING_STEPS)
            records = rundir.read_log(trainer.out)[TIMING_SKIP:]
            step_s[name] = statistics.median(trainer.cfg.batch_size / r["images_per_s"] for r in records)
            if eval_s is None:  # about the same for every method: the same encoder, data and probe
                tic = time.perf_counter()
                evaluate(trainer.learner, trainer.data, trainer.cfg, trainer.device)
                eval_s = time.perf_counter() - tic
            steps_per_epoch = trainer.steps_per_epoch
            del trainer
    left = 60 * budget_minutes - (time.perf_counter() - started)
    fixed = len(seeds) * sum(build_s[name] + eval_s for name in configs)
    epoch = len(seeds) * steps_per_epoch * sum(step_s.values())
    epochs = budget_epochs(left, fixed, epoch, max_epochs, budget_minutes)
    plan = dict(key=key, epochs=epochs, max_epochs=max_epochs, steps_per_epoch=steps_per_epoch, step_s=step_s,
                build_s=build_s, eval_s=eval_s, left_s=left, planned_s=fixed + epochs * epoch)
    rundir.output_folder(out, named=True)
    rundir.write_json(plan, path)
    return plan
