"""The training loop: dataset -> augment -> encoder -> (model, guide) -> -ELBO -> optimizer, then evaluation.

One ``Trainer`` owns a run folder (``rundir.py`` lists its files and does the writing and reading).
Running the same command again in the same folder resumes from ``checkpoint.pt``; a finished run is
not retrained (its results are printed again). SIGINT/SIGTERM stop it at the next step boundary with
a checkpoint; a SIGKILL loses at most the steps since the last one. ``docs/RELIABILITY.md`` lists every
fault handled and what the user sees.
"""

import json
import random
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyro
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Sampler

from bayesncl_pyro import __version__, distributed, rundir
from bayesncl_pyro.data import pipeline
from bayesncl_pyro.data.views import TwoViews, simclr_transform
from bayesncl_pyro.config import Config, resolve
from bayesncl_pyro.data import image_files, load_dataset
from bayesncl_pyro.data.decode import EncodedImages
from bayesncl_pyro.data.resident import resident_images
from bayesncl_pyro.diagnostics import CONFLICT_FILE, conflict_record, degeneracy_warnings, gate_pulls, to_json
from bayesncl_pyro.errors import Stopped, UserError
from bayesncl_pyro.evaluation import evaluate, format_table
from bayesncl_pyro.learner import ContrastiveLearner
from bayesncl_pyro.metrics import ACTIVE_EPS
from bayesncl_pyro.optim import build_optimizer, build_scheduler
from bayesncl_pyro.rundir import BAD_IMAGES, CHECKPOINT, EVAL, LOG, append_line, atomic_save, write_json


class EpochSampler(Sampler):
    """A permutation of the training set that depends only on (seed, epoch), started at batch ``start``:
    resuming mid-epoch replays exactly the remaining batches of the interrupted epoch. Yields
    ``epoch * n + i`` so that ``TwoViews`` can seed each item's augmentations by epoch and item.
    Under DDP rank r of W takes the r-th slice (batch_size / W items) of every global batch, so the
    ranks together see the batches of a single-process run."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.rank, self.world = rank, world
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0):
        self.epoch, self.start = epoch, start_batch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        whole = self.n // self.batch_size * self.batch_size  # the last, partial batch is dropped
        order = torch.randperm(self.n, generator=g)[self.start * self.batch_size:whole]
        order = order.view(-1, self.world, self.batch_size // self.world)[:, self.rank].reshape(-1)
        return iter((order + self.epoch * self.n).tolist())

    def __len__(self):
        return (self.n // self.batch_size - self.start) * (self.batch_size // self.world)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but PyTorch sees no CUDA GPU; use --device cpu or auto")
    return torch.device(name)


# the terms of the -ELBO whose gradients reach each part of the learner (the gating head sees h.detach())
_TERMS = {"encoder": "InfoNCE", "model": "KL", "guide": "InfoNCE or KL"}


class _StopRequest:
    """Within ``with``: SIGINT and SIGTERM only set ``signum``, so training stops at the next step boundary
    with a checkpoint; a second signal acts as usual (the first one puts the old handlers back)."""

    def __enter__(self):
        self.signum, self.previous = None, {}
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self.previous = {s: signal.signal(s, self._note) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _note(self, signum, frame):
        self.signum = signum  # no printing here: the handler may interrupt a write to the same stream
        self.__exit__()

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _ignore_sigint(worker_id: int):
    # Ctrl-C reaches the whole process group: workers keep serving batches while the main process
    # finishes the step and checkpoints (they end with it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _collate(batch):
    """(v1, v2, label, index) items -> one tensor of 2B rows [view 1; view 2]."""
    v1, v2, _, _ = zip(*batch)
    return torch.cat([torch.stack(v1), torch.stack(v2)])


class Trainer:
    """Trains one run and evaluates it. ``Trainer(cfg).fit()`` returns the evaluation dict."""

    def __init__(self, cfg: Config, progress: bool | None = None, overwrite: bool = False):
        """``overwrite``: move whatever the run folder holds into a ``previous-<time>`` subfolder and
        start afresh, instead of resuming the run there or refusing one with another config."""
        self.cfg = cfg = resolve(cfg)
        self.out = Path(cfg.out)
        self.rank, self.world, self.device = distributed.setup(pick_device(cfg.device))
        if cfg.batch_size % self.world:
            raise UserError(f"--batch-size {cfg.batch_size} (the global batch) does not split evenly over "
                            f"{self.world} processes; pick a multiple of {self.world}")
        self.progress = (sys.stderr.isatty() if progress is None else progress) and self.rank == 0
        if self.rank == 0:
            rundir.claim(self.out, cfg, overwrite)
        distributed.barrier()
        pyro.set_rng_seed(cfg.seed)
        self.data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, skip_bad=cfg.skip_bad_images,
                                 train_subset=cfg.train_subset)
        files = image_files(self.data.train)
        for split in (files, image_files(self.data.test)):
            if split is not None:  # image files: every loader worker appends what it skips here
                split.bad_log = self.out / BAD_IMAGES
        # where the views are drawn: None, in the loader workers (per image, on the CPU); else on the device,
        # in batches (pipeline.py), of the training set held there when it fits (one size, small enough),
        # else of the batch's files. auto: on the device when training on CUDA, whose GPU outpaces CPU workers,
        # and for in-memory training sets (digits, CIFAR pickles, compositional) anywhere: on a CPU too, batched
        # views of small images cost a fraction of the step, where per-image views in workers cost more than it
        self.views = None
        if cfg.augment == "device" or (cfg.augment == "auto" and (self.device.type == "cuda" or files is None)):
            resident = resident_images(self.data.train, self.device, cfg.workers)
            if resident is not None:
                self.views = pipeline.ResidentViews(resident, cfg.image_size, cfg.seed, self.rank)
            elif files is not None:
                self.views = pipeline.FileViews(EncodedImages(self.data.train), cfg.image_size, cfg.seed, self.rank,
                                                self.device)
            elif cfg.augment == "device":
                raise UserError(f"--augment device: {cfg.dataset}'s training set does not fit in a quarter of the "
                                f"{self.device.type} memory free; use --augment workers")
        if len(self.data.train) < cfg.batch_size:
            raise UserError(f"--batch-size {cfg.batch_size} is larger than the training set "
                            f"({len(self.data.train)} images); lower it")
        # channels_last: the layout cuDNN's tensor-core convolutions want
        self.memory_format = torch.channels_last if self.device.type == "cuda" else torch.preserve_format
        self.learner = ContrastiveLearner(cfg, self.data.channels, len(self.data.train)).to(
            self.device, memory_format=self.memory_format)
        if self.world > 1 and self.device.type == "cuda":
            self.learner = nn.SyncBatchNorm.convert_sync_batchnorm(self.learner)
        if self.rank:  # same initial weights everywhere, then each rank its own gate noise
            pyro.set_rng_seed(cfg.seed + 1_000_003 * self.rank)
        self.steps_per_epoch = len(self.data.train) // cfg.batch_size
        self.total_steps = cfg.epochs * self.steps_per_epoch
        self.optimizer = build_optimizer(cfg.optimizer, self.learner.param_groups(), cfg.momentum,
                                         cfg.weight_decay)
        self.scheduler = build_scheduler(self.optimizer, round(cfg.warmup_epochs * self.steps_per_epoch),
                                         self.total_steps)
        self.step = self.saved_step = self.skipped_steps = 0
        self.finished = False
        self._degenerate = False
        self._load_checkpoint()
        self.net = self.learner  # what the training step calls: the learner, or its DDP wrapper
        if self.world > 1:
            self.learner.model.gather = distributed.gather_rows
            on_gpu = self.device.type == "cuda"
            self.net = DistributedDataParallel(self.learner, device_ids=[self.device] if on_gpu else None)
        if cfg.compile:
            self.learner.encoder.compile()

    def state_dict(self) -> dict:
        return dict(version=__version__, config=self.cfg.to_dict(), step=self.step, finished=self.finished,
                    num_train=len(self.data.train), channels=self.data.channels,
                    learner=self.learner.state_dict(), optimizer=self.optimizer.state_dict(),
                    scheduler=self.scheduler.state_dict(), skipped_steps=self.skipped_steps,
                    rng=distributed.all_gather_objects(  # one entry per rank
                        dict(torch=torch.get_rng_state(), python=list(random.getstate()[1]),
                             cuda=torch.cuda.get_rng_state_all() if self.device.type == "cuda" else [])))

    def save(self):
        """Every rank calls this (it gathers their RNG states); rank 0 writes the file."""
        state = self.state_dict()
        if self.rank == 0:
            atomic_save(state, self.out / CHECKPOINT)
        self.saved_step = self.step

    def _load_checkpoint(self):
        path = self.out / CHECKPOINT
        if not path.exists():
            return
        state = rundir.load_checkpoint(path)
        what = Config.from_dict(state["config"]).differences(self.cfg)
        if what:
            raise UserError(f"{path} was written by a run with another configuration ({what}); "
                            "move it away, or rerun with the flags it was made with")
        if state["num_train"] != len(self.data.train):
            raise UserError(f"{path} was trained on {state['num_train']} images but the training set now "
                            f"holds {len(self.data.train)}; point --data-dir at the data it was made with")
        rundir.load_weights(self.learner, state, path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if len(state["rng"]) != self.world:
            raise UserError(f"{path} was written by {len(state['rng'])} training process(es), this run has "
                            f"{self.world}; resume it with torchrun --nproc_per_node={len(state['rng'])}")
        rng = state["rng"][self.rank]
        torch.set_rng_state(rng["torch"])
        random.setstate((3, tuple(rng["python"]), None))
        if rng["cuda"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.step, self.finished = state["step"], state["finished"]
        self.saved_step, self.skipped_steps = self.step, state.get("skipped_steps", 0)

    # -- training -----------------------------------------------------------------------------
    def _loader(self, sampler: EpochSampler):
        """What ``_input`` draws an epoch's steps from: the loader of the views or files, or index rows."""
        cfg = self.cfg
        if isinstance(self.views, pipeline.ResidentViews):  # the images are on the device already
            return self.views.batches(sampler, cfg.batch_size // self.world)
        if self.views is not None:  # workers only read files; _input decodes and augments
            dataset, collate = self.views.encoded, list
        else:
            dataset = TwoViews(self.data.train, simclr_transform(cfg.image_size, self.data.channels), cfg.seed)
            collate = _collate
        # its own generator: creating an epoch's iterator must not draw from the global RNG, which
        # the gate samples use and the checkpoint restores. Pinned memory only for views: file bytes go to
        # the decoder from wherever they are
        return DataLoader(dataset, batch_size=cfg.batch_size // self.world, sampler=sampler, drop_last=True,
                          num_workers=cfg.workers, collate_fn=collate,
                          pin_memory=self.device.type == "cuda" and self.views is None,
                          persistent_workers=cfg.workers > 0, generator=torch.Generator(),
                          worker_init_fn=_ignore_sigint)

    def _input(self, loader) -> Iterator[torch.Tensor]:
        """The inputs of the steps from ``self.step`` on, one per batch of ``loader`` (``_loader``), on the device:
        2B rows [view 1; view 2]. Views drawn on the device depend on (seed, step, rank) alone, so a resumed run
        draws the same ones; on CUDA they are drawn a batch ahead, in the input pipeline's thread."""
        if self.views is None:
            return (batch.to(self.device, non_blocking=True, memory_format=self.memory_format) for batch in loader)
        first = self.step

        def views(batch, k: int) -> torch.Tensor:
            return self.views(batch, first + k).contiguous(memory_format=self.memory_format)

        return pipeline.prefetch(loader, views, self.device, pipeline.AHEAD if self.device.type == "cuda" else 0)

    def fit(self) -> dict:
        if self.finished and (self.out / EVAL).exists():
            results = json.loads((self.out / EVAL).read_text())
            if self.rank == 0:
                print(f"{self.out} already holds a finished run; its results (pass another --out to train again):")
                print(format_table(results))
            return results
        last = self.total_steps if self.cfg.max_steps is None else min(self.total_steps, self.cfg.max_steps)
        if self.step < last:
            self.train(last)
        self.finished = True
        self.save()
        if self.rank:
            return {}
        results = evaluate(self.learner, self.data, self.cfg, self.device)
        write_json(results, self.out / EVAL)
        print(format_table(results))
        self._report_skipped()
        return results

    def train(self, last_step: int):
        cfg, learner = self.cfg, self.learner
        learner.train()
        sampler = EpochSampler(len(self.data.train), cfg.batch_size, cfg.seed, self.rank, self.world)
        loader = self._loader(sampler)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=last_step, initial=self.step, unit="step", dynamic_ncols=True)
        stopping = False
        with pyro.validation_enabled(False), _StopRequest() as stop:
            tic, seen = time.perf_counter(), 0
            while self.step < last_step and not stopping:
                epoch, start = divmod(self.step, self.steps_per_epoch)
                sampler.set_epoch(epoch, start)
                for x in self._input(loader):
                    loss = self.net(x)
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    if self._check_finite(loss):
                        self.optimizer.step()
                    self.scheduler.step()
                    self.step += 1
                    seen += x.shape[0] // 2 * self.world
                    # rank 0 logs its own rows' loss (an unbiased estimate of the global one); reading
                    # it syncs with the GPU, so only every log_every steps
                    if self.rank == 0 and (self.step % cfg.log_every == 0 or self.step == last_step):
                        rec = self._record(loss, epoch, seen / (time.perf_counter() - tic))
                        tic, seen = time.perf_counter(), 0
                        append_line(json.dumps(rec), self.out / LOG)
                        if bar is None:
                            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in rec.items()), flush=True)
                        else:
                            bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                    if bar is not None:
                        bar.update(1)
                    if self.rank == 0 and cfg.conflict_every and self.step % cfg.conflict_every == 0:
                        append_line(self._conflict_line(), self.out / CONFLICT_FILE)
                    # a signal reaches one rank or all; they must stop, and save, at the same step
                    stopping = distributed.any_rank(stop.signum is not None, self.device)
                    if self.step % cfg.ckpt_every == 0 or stopping:
                        self.save()
                    if self.step >= last_step or stopping:
                        break
        if bar is not None:
            bar.close()
        learner.eval()
        if stopping:
            signum = stop.signum or signal.SIGTERM  # a rank that got no signal stops as if terminated
            raise Stopped(f"{signal.Signals(signum).name} received: checkpoint saved at step {self.step} "
                          f"of {last_step} in {self.out}; rerun the same command to resume", signum)

    def _check_finite(self, loss: torch.Tensor) -> bool:
        """Whether the loss and every gradient are finite, so the step may be taken. If not, stop the run
        with a message naming the step and the term (the checkpoint on disk stays the last good one),
        or with ``on_nan="skip"`` warn and return False."""
        grads = [p.grad for p in self.learner.parameters() if p.grad is not None]
        if torch.isfinite(loss + torch.nn.utils.get_total_norm(grads)):  # any inf/nan makes the sum one
            return True
        nce = self.learner.model.last_nce
        if not torch.isfinite(nce):
            what = f"the InfoNCE term is {nce.item()}"
        elif not torch.isfinite(loss):
            what = f"the KL term is {(loss - nce).item()}"
        else:
            name = next((n for n, p in self.learner.named_parameters()
                         if p.grad is not None and not p.grad.isfinite().all()), None)
            what = (f"the gradient of {name} (from {_TERMS[name.split('.')[0]]}) is not finite" if name
                    else "the gradient norm overflows")
        if self.cfg.on_nan == "skip":
            self.skipped_steps += 1
            print(f"warning: step {self.step + 1}: {what}; step skipped (--on-nan skip)", file=sys.stderr)
            return False
        kept = f"the last good checkpoint (step {self.saved_step})" if self.saved_step else "no checkpoint"
        raise UserError(f"training diverged at step {self.step + 1}: {what}; {kept} is kept in {self.out}. "
                        "Lower --lr (or --kl-weight), or pass --on-nan skip to skip such steps")

    def _report_skipped(self):
        """Warn about what the run skipped: non-finite steps (--on-nan skip), unreadable images."""
        if self.skipped_steps:
            print(f"warning: {self.skipped_steps} of {self.step} steps were skipped for a non-finite loss or "
                  "gradient", file=sys.stderr)
        bad = self.out / BAD_IMAGES
        if bad.exists():
            count = len(set(bad.read_text().splitlines()))
            print(f"warning: {count} unreadable images were skipped; they are listed in {bad}", file=sys.stderr)

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
            g = learner.model.last_g
            if g.grad is not None:
                rec["gate_nce_pull"], rec["gate_prior_pull"] = gate_pulls(
                    g.grad, probs, learner.model.prior.mean_rate(), cfg.kl_weight, cfg.kl_clamp)
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
