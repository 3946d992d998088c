"""The training loop: dataset -> augment -> encoder -> (model, guide) -> -ELBO -> optimizer, then evaluation.

One ``Trainer`` owns a run folder::

    config.json     the resolved Config (what was actually run)
    checkpoint.pt   state_dicts, optimizer, scheduler, RNG states, step; replaced atomically
    log.jsonl       one JSON object every ``log_every`` steps (with ``warnings`` when the gates degenerate)
    conflict.jsonl  the per-dimension InfoNCE gradient conflict every ``conflict_every`` steps (diagnostics.py)
    eval.json       the evaluation of the final model
    gates.nc        BayesNCL only: the gate posterior on the test split, as ArviZ data (arviz_export.py)

Running the same command again in the same folder resumes from ``checkpoint.pt``; a finished run is
not retrained (its results are printed again).
"""

import json
import os
import random
import sys
import time
from pathlib import Path

import pyro
import torch
from torch.utils.data import DataLoader, Sampler

from bayesncl_pyro import __version__
from bayesncl_pyro.augment import TwoViews, eval_transform, simclr_transform
from bayesncl_pyro.config import Config, resolve
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.diagnostics import CONFLICT_FILE, conflict_record, degeneracy_warnings, to_json
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluation import evaluate, format_table
from bayesncl_pyro.learner import ContrastiveLearner
from bayesncl_pyro.metrics import ACTIVE_EPS
from bayesncl_pyro.optim import build_optimizer, build_scheduler

CHECKPOINT = "checkpoint.pt"


class EpochSampler(Sampler):
    """A permutation of the training set that depends only on (seed, epoch), started at batch ``start``:
    resuming mid-epoch replays exactly the remaining batches of the interrupted epoch. Yields
    ``epoch * n + i`` so that ``TwoViews`` can seed each item's augmentations by epoch and item."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0):
        self.epoch, self.start = epoch, start_batch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.n, generator=g)[self.start * self.batch_size:]
        return iter((order + self.epoch * self.n).tolist())

    def __len__(self):
        return self.n - self.start * self.batch_size


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but PyTorch sees no CUDA GPU; use --device cpu or auto")
    return torch.device(name)


def atomic_save(obj, path: Path):
    """Write to a temporary file in the same folder, fsync, then rename: a crash mid-write leaves the
    previous file intact."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(obj, path: Path):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _collate(batch):
    """(v1, v2, label, index) items -> one tensor of 2B rows [view 1; view 2]."""
    v1, v2, _, _ = zip(*batch)
    return torch.cat([torch.stack(v1), torch.stack(v2)])


class Trainer:
    """Trains one run and evaluates it. ``Trainer(cfg).fit()`` returns the evaluation dict."""

    def __init__(self, cfg: Config, progress: bool | None = None):
        self.cfg = cfg = resolve(cfg)
        self.out = Path(cfg.out)
        self.device = pick_device(cfg.device)
        self.progress = sys.stderr.isatty() if progress is None else progress
        self._claim_folder()
        pyro.set_rng_seed(cfg.seed)
        self.data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
        if len(self.data.train) < cfg.batch_size:
            raise UserError(f"--batch-size {cfg.batch_size} is larger than the training set "
                            f"({len(self.data.train)} images); lower it")
        self.learner = ContrastiveLearner(cfg, self.data.channels, len(self.data.train)).to(self.device)
        self.steps_per_epoch = len(self.data.train) // cfg.batch_size
        self.total_steps = cfg.epochs * self.steps_per_epoch
        self.optimizer = build_optimizer(cfg.optimizer, self.learner.param_groups(), cfg.momentum,
                                         cfg.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, round(cfg.warmup_epochs * self.steps_per_epoch),
                                         self.total_steps)
        self.step = 0
        self.finished = False
        self._degenerate = False
        self._load_checkpoint()

    # -- run folder ---------------------------------------------------------------------------
    def _claim_folder(self):
        """Create the run folder, or check that the one there holds this very run."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the output folder {self.out}: {e.strerror}; choose another --out")
        saved = self.out / "config.json"
        if saved.exists():
            old = Config.from_dict(json.loads(saved.read_text()))
            diff = {k: (v, self.cfg.identity()[k]) for k, v in old.identity().items() if self.cfg.identity()[k] != v}
            if diff:
                what = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in ((k, *ab) for k, ab in diff.items()))
                raise UserError(f"{self.out} holds a run with a different configuration ({what}); "
                                "rerun with the same flags to resume it, or pass another --out")
        try:
            write_json(self.cfg.to_dict(), saved)
        except OSError as e:
            raise UserError(f"cannot write to the output folder {self.out}: {e.strerror}; choose another --out")

    def state_dict(self) -> dict:
        return dict(version=__version__, config=self.cfg.to_dict(), step=self.step, finished=self.finished,
                    num_train=len(self.data.train), channels=self.data.channels,
                    learner=self.learner.state_dict(), optimizer=self.optimizer.state_dict(),
                    scheduler=self.scheduler.state_dict(),
                    rng=dict(torch=torch.get_rng_state(), python=list(random.getstate()[1]),
                             cuda=torch.cuda.get_rng_state_all() if self.device.type == "cuda" else []))

    def save(self):
        atomic_save(self.state_dict(), self.out / CHECKPOINT)

    def _load_checkpoint(self):
        path = self.out / CHECKPOINT
        if not path.exists():
            return
        state = load_checkpoint(path)
        self.learner.load_state_dict(state["learner"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate((3, tuple(state["rng"]["python"]), None))
        if state["rng"]["cuda"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.step, self.finished = state["step"], state["finished"]

    # -- training -----------------------------------------------------------------------------
    def _loader(self, sampler: EpochSampler) -> DataLoader:
        cfg = self.cfg
        views = TwoViews(self.data.train, simclr_transform(cfg.image_size, self.data.channels), cfg.seed)
        # its own generator: creating an epoch's iterator must not draw from the global RNG, which
        # the gate samples use and the checkpoint restores
        return DataLoader(views, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                          num_workers=cfg.workers, collate_fn=_collate, pin_memory=self.device.type == "cuda",
                          persistent_workers=cfg.workers > 0, generator=torch.Generator())

    def fit(self) -> dict:
        if self.finished and (self.out / "eval.json").exists():
            results = json.loads((self.out / "eval.json").read_text())
            print(f"{self.out} already holds a finished run; its results (pass another --out to train again):")
            print(format_table(results))
            return results
        last = self.total_steps if self.cfg.max_steps is None else min(self.total_steps, self.cfg.max_steps)
        if self.step < last:
            self.train(last)
        self.finished = True
        self.save()
        results = evaluate(self.learner, self.data, self.cfg, self.device)
        write_json(results, self.out / "eval.json")
        if self.learner.gated:
            from bayesncl_pyro.arviz_export import export_gates  # late: arviz is slow to import

            export_gates(self.out, self.learner, self.data)
        print(format_table(results))
        return results

    def train(self, last_step: int):
        cfg, learner = self.cfg, self.learner
        learner.train()
        sampler = EpochSampler(len(self.data.train), cfg.batch_size, cfg.seed)
        loader = self._loader(sampler)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=last_step, initial=self.step, unit="step", dynamic_ncols=True)
        with open(self.out / "log.jsonl", "a") as log, open(self.out / CONFLICT_FILE, "a") as conflict, \
                pyro.validation_enabled(False):
            tic, seen = time.perf_counter(), 0
            while self.step < last_step:
                epoch, start = divmod(self.step, self.steps_per_epoch)
                sampler.set_epoch(epoch, start)
                for x in loader:
                    loss = learner(x.to(self.device, non_blocking=True))
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    self.optimizer.step()
                    self.scheduler.step()
                    self.step += 1
                    seen += x.shape[0] // 2
                    if self.step % cfg.log_every == 0 or self.step == last_step:
                        rec = self._record(loss, epoch, seen / (time.perf_counter() - tic))
                        tic, seen = time.perf_counter(), 0
                        log.write(json.dumps(rec) + "\n")
                        log.flush()
                        if bar is None:
                            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in rec.items()), flush=True)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
                    if cfg.conflict_every and self.step % cfg.conflict_every == 0:
                        conflict.write(self._conflict_line() + "\n")
                        conflict.flush()
                    if self.step % cfg.ckpt_every == 0:
                        self.save()
                    if self.step >= last_step:
                        break
        if bar is not None:
            bar.close()
        learner.eval()

    def _record(self, loss: torch.Tensor, epoch: int, images_per_s: float) -> dict:
        """One log line: the -ELBO per row split into its InfoNCE and KL terms, the share of feature entries
        that take part in the loss (``active``), and the gates' state."""
        learner, cfg = self.learner, self.cfg
        loss, nce = loss.item(), learner.model.last_nce.item()
        grads = [p.grad for p in learner.parameters() if p.grad is not None]
        rec = dict(step=self.step, epoch=epoch, lr=self.optimizer.param_groups[0]["lr"], loss=loss, nce=nce,
                   kl=(loss - nce) / cfg.kl_weight if learner.gated else 0.0,
                   grad_norm=torch.nn.utils.get_total_norm(grads).item(), images_per_s=images_per_s,
                   active=(learner.model.last_u.abs() > ACTIVE_EPS).float().mean().item())
        if learner.gated:
            probs = learner.guide.last_probs
            per_dim = probs.mean(0)
            rec.update(gate_rate=probs.mean().item(), incl_min=per_dim.min().item(),
                       incl_max=per_dim.max().item())
        warnings = degeneracy_warnings(rec, cfg.proj_dim)
        if warnings:
            rec["warnings"] = warnings
            if not self._degenerate:  # every record carries them; the terminal hears once per episode
                print(f"warning: step {self.step}: " + "; ".join(warnings), file=sys.stderr, flush=True)
        self._degenerate = bool(warnings)
        return rec

    def _conflict_line(self) -> str:
        """One conflict.jsonl line: the InfoNCE gradient parts per dimension on this step's batch, and for
        BayesNCL each dimension's mean inclusion probability (``incl``)."""
        rec = dict(step=self.step, **conflict_record(self.learner.model.last_u, self.cfg.temperature))
        if self.learner.gated:
            rec["incl"] = self.learner.guide.last_probs.mean(0)
        return to_json(rec)


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint without executing code from it (weights-only unpickling)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure means the file is not a usable checkpoint
        raise UserError(f"cannot read checkpoint {path}: {e.__class__.__name__}: {str(e).splitlines()[0]}; "
                        "it is corrupt or not a bayesncl-pyro checkpoint (move it away to start afresh)")


def load_learner(run_dir: str | os.PathLike, device: str = "cpu") -> tuple[ContrastiveLearner, Config]:
    """The trained learner of a run folder (for notebooks and evaluation), in eval mode."""
    state = load_checkpoint(Path(run_dir) / CHECKPOINT)
    cfg = Config.from_dict(state["config"])
    learner = ContrastiveLearner(cfg, state["channels"], state["num_train"])
    learner.load_state_dict(state["learner"])
    return learner.to(device).eval(), cfg

