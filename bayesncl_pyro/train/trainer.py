"""The training loop: dataset -> augment -> encoder -> (model, guide) -> -ELBO -> optimizer, then evaluation.

One ``Trainer`` owns a run folder (``rundir.py`` lists its files and does the writing and reading).
Running the same command again in the same folder resumes from ``checkpoint.pt``; a finished run is
not retrained (its results are printed again), and one made by another number of processes continues.
SIGINT, SIGTERM and SIGUSR1 stop it at a step boundary with a checkpoint; a SIGKILL loses at most the steps
since the last one. ``docs/RELIABILITY.md`` lists every fault handled and what the user sees.
"""

import contextlib
import json
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyro
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Sampler

from bayesncl_pyro import __version__, distributed, rundir
from bayesncl_pyro.config import Config
from bayesncl_pyro.data import image_files, load_dataset, pipeline
from bayesncl_pyro.data.decode import EncodedBatch, EncodedImages, no_jpeg_decoder
from bayesncl_pyro.data.resident import resident_images
from bayesncl_pyro.data.views import TwoViews, collate_views, simclr_transform
from bayesncl_pyro.device import pick_device
from bayesncl_pyro.errors import Stopped, UserError
from bayesncl_pyro.evaluate.diagnostics import CONFLICT_FILE, conflict_record, degeneracy_warnings, to_json
from bayesncl_pyro.evaluate.heldout import evaluate, format_table, test_features
from bayesncl_pyro.infer.learner import ContrastiveLearner, load_weights
from bayesncl_pyro.loggers import TensorBoardLog, WandbLog, duration, reporter
from bayesncl_pyro.nn.optim import build_optimizer, build_scheduler, load_optimizer_state
from bayesncl_pyro.rundir import BAD_IMAGES, CHECKPOINT, CONFIG, EVAL, LOG, append_line, atomic_save, write_json
from bayesncl_pyro.train.guard import CHECK_EVERY, DivergenceGuard, StopRequest
from bayesncl_pyro.train.monitor import Monitor
from bayesncl_pyro.train.resolve import resolve


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


def _ignore_sigint(worker_id: int):
    # Ctrl-C reaches the whole process group: workers keep serving batches while the main process
    # finishes the step and checkpoints (they end with it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


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
        self._lock = None  # rank 0's lock on the run folder, held while the trainer lives
        if self.rank == 0:
            self._lock = rundir.claim(self.out, cfg, overwrite)
        distributed.barrier()
        pyro.set_rng_seed(cfg.seed)
        self.data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, skip_bad=cfg.skip_bad_images,
                                 train_subset=cfg.train_subset)
        # the rows every rank gathers each step follow from these, and the steps and checkpoints of all
        distributed.check_agreement(dict(cfg.identity(), max_steps=cfg.max_steps, ckpt_every=cfg.ckpt_every,
                                         training_images=len(self.data.train)))
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
                why_not = no_jpeg_decoder(self.device)
                if why_not is not None and self.rank == 0:
                    print(f"note: {why_not}; JPEGs are decoded in the loader workers instead", file=sys.stderr)
                self.views = pipeline.FileViews(EncodedImages(self.data.train, why_not is None), cfg.image_size,
                                                cfg.seed, self.rank, self.device)
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
        if self.world > 1 and self.device.type == "cuda":  # a host sync per layer and step (docs/PERFORMANCE.md)
            self.learner = nn.SyncBatchNorm.convert_sync_batchnorm(self.learner)
        self.test_features = None  # the evaluation's pass over the test split, which the gate export reads too
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
        self._stop = StopRequest()
        self._degenerate = False
        self._load_checkpoint()
        self.net = self.learner  # what the training step calls: the learner, or its DDP wrapper
        if self.world > 1:  # the learner's head gathers the negatives of every rank by itself
            on_gpu = self.device.type == "cuda"
            self.net = DistributedDataParallel(self.learner, device_ids=[self.device] if on_gpu else None)
        if cfg.compile:
            # after the wrap, as PyTorch documents for DDP (notes/ddp, "TorchDynamo DDPOptimizer"); compilation is
            # lazy: dynamo compiles the backbone at its first call, inside DDP's forward, sees the DDP module there and
            # splits the graph at DDP's gradient buckets, so that each bucket's all-reduce starts as soon as its part
            # of the backward has run, while the rest runs
            self.learner.backbone.compile()
        self.check_every = min(cfg.log_every, CHECK_EVERY)
        self.guard = DivergenceGuard(self.learner, self.optimizer, cfg.on_nan == "skip", self.check_every)
        self.loggers, self.monitor = [], None
        if self.rank == 0:  # set up without a refusal: the folder is this run's now
            write_json(cfg.to_dict(), self.out / CONFIG)
            if not (self.finished and (self.out / EVAL).exists()):  # else there is nothing left to log
                self.loggers = ([TensorBoardLog(self.out)] if cfg.tensorboard else []) + (
                    [WandbLog(self.out, cfg.to_dict())] if cfg.wandb else [])
            if cfg.monitor_every:
                self.monitor = Monitor(self.learner, self.data, cfg, self.device)

    def state_dict(self) -> dict:
        return dict(version=__version__, config=self.cfg.to_dict(), step=self.step, finished=self.finished,
                    num_train=len(self.data.train), channels=self.data.channels,
                    learner=self.learner.state_dict(), optimizer=self.optimizer.state_dict(),
                    scheduler=self.scheduler.state_dict(), skipped_steps=self.skipped_steps,
                    rng=distributed.all_gather_objects(  # one entry per rank
                        dict(torch=torch.get_rng_state(), python=list(random.getstate()[1]),
                             cuda=torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)))

    def save(self):
        """Every rank calls this (it gathers their RNG states); rank 0 writes the file, and no rank goes on (or
        exits: torchrun then stops the others) before it is written. A step not yet checked for divergence is
        checked first: no checkpoint holds a bad step."""
        self._check_divergence()
        state = self.state_dict()
        if self.rank == 0:
            atomic_save(state, self.out / CHECKPOINT)
        distributed.barrier()
        self.saved_step, self.saved_at = self.step, time.monotonic()

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
        load_weights(self.learner, state, path)
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        if len(state["rng"]) == self.world:
            rng = state["rng"][self.rank]
            torch.set_rng_state(rng["torch"])
            random.setstate((3, tuple(rng["python"]), None))
            if self.device.type == "cuda":
                self._restore_cuda_rng(rng["cuda"], path)
        else:  # each process's own streams cannot be split or merged: every rank starts one from (seed, step, rank)
            pyro.set_rng_seed(((self.cfg.seed * 1_000_003 + self.step) * 1_009 + self.rank) % 2**32)
            if self.rank == 0:
                print(f"note: {path} was written by {len(state['rng'])} process(es), this run has {self.world}: the "
                      f"global batch ({self.cfg.batch_size}), data order and schedule continue; gate noise and "
                      "device-drawn views come from per-process random streams, which restart, so the numbers "
                      "differ from an uninterrupted run's", file=sys.stderr, flush=True)
        self.finished = state["finished"]
        self.saved_step, self.skipped_steps = self.step, state.get("skipped_steps", 0)

    def _restore_cuda_rng(self, saved: torch.Tensor | list | None, path: Path):
        """Continue the CUDA random stream (gate noise) of the GPU that wrote the checkpoint on this run's GPU, whatever
        its index. ``saved``: that GPU's state; None from a run on the CPU; in older checkpoints a list of the states of
        every GPU that process saw, of which this device's index is taken."""
        if isinstance(saved, list):
            index = self.device.index
            if saved and index >= len(saved):
                print(f"note: {path} holds the CUDA random states of {len(saved)} GPU(s), none for {self.device}: its "
                      "CUDA random stream (gate noise) restarts, so the numbers differ from an uninterrupted run's",
                      file=sys.stderr, flush=True)
            saved = saved[index] if index < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(saved, self.device)

    # -- training -----------------------------------------------------------------------------
    def _loader(self, sampler: EpochSampler):
        """What ``_input`` draws an epoch's steps from: the loader of the views or files, or index rows."""
        cfg = self.cfg
        if isinstance(self.views, pipeline.ResidentViews):  # the images are on the device already
            return self.views.batches(sampler, cfg.batch_size // self.world)
        if self.views is not None:  # workers only read files; _input decodes and augments
            dataset, collate = self.views.encoded, EncodedBatch
        else:
            dataset = TwoViews(self.data.train, simclr_transform(cfg.image_size, self.data.channels), cfg.seed)
            collate = collate_views
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
            results = rundir.read_eval(self.out, self.cfg.gate)
            if self.rank == 0:
                print(f"{self.out} already holds a finished run; its results (pass another --out to train again):")
                print(format_table(results))
            return results
        last = self.total_steps if self.cfg.max_steps is None else min(self.total_steps, self.cfg.max_steps)
        with self._stop as stop:  # a signal during the last step or the final write is noted, never lost or raised
            if self.step < last:
                self.train(last)
            self.finished = True
            self.save()
        if stop.signum:  # no collective follows: each rank can act on its own
            raise Stopped(f"{signal.Signals(stop.signum).name} received: training finished, checkpoint saved at step "
                          f"{self.step} in {self.out}; rerun the same command to evaluate it", stop.signum)
        if self.rank:
            return {}
        progress = reporter(bar=self.progress)
        self.test_features = test_features(self.learner, self.data, self.device, progress)
        results = evaluate(self.learner, self.data, self.cfg, self.device, progress, self.test_features)
        write_json(results, self.out / EVAL)
        for log in self.loggers:
            log.evaluation(results, self.step)
            log.close()
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
        stopping, votes, minutes, estimated = 0, distributed.Votes(), cfg.ckpt_minutes, False
        self.saved_at = time.monotonic()  # rank 0's clock decides --ckpt-minutes; nothing is unsaved yet
        with pyro.validation_enabled(False), self._stop as stop, self._naming_divergence():
            tic, seen = time.perf_counter(), 0
            while self.step < last_step and not stopping:
                epoch, start = divmod(self.step, self.steps_per_epoch)
                sampler.set_epoch(epoch, start)
                for x in self._input(loader):
                    loss, stats = self._step(x, last_step)
                    seen += x.shape[0] // 2 * self.world
                    # rank 0 logs its own rows' loss (an unbiased estimate of the global one); reading
                    # it syncs with the GPU, so only every log_every steps
                    # not at the last step: the evaluation that follows has the whole data's kNN
                    monitor = self.monitor is not None and self.step % (cfg.monitor_every * self.steps_per_epoch) == 0 \
                        and self.step < last_step
                    if self.rank == 0 and (self.step % cfg.log_every == 0 or self.step == last_step or monitor):
                        rec = self._record(loss, stats, epoch, seen / (time.perf_counter() - tic))
                        if monitor:  # outside the time images_per_s measures
                            rec.update(self.monitor())
                        tic, seen = time.perf_counter(), 0
                        append_line(json.dumps(rec), self.out / LOG)
                        for log in self.loggers:
                            log.record(rec, stats["probs"].mean(0) if learner.gated else None)
                        if bar is None:
                            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in rec.items()), flush=True)
                            if not estimated:  # a bar shows the time to go; a log needs a line for it
                                estimated = True
                                left = (last_step - self.step) * cfg.batch_size / rec["images_per_s"]
                                print(f"at {rec['images_per_s']:.4g} images/s, the {last_step - self.step} steps "
                                      f"left take about {duration(left)}", flush=True)
                        else:
                            bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)
                    if bar is not None:
                        bar.update(1)
                    if self.rank == 0 and cfg.conflict_every and self.step % cfg.conflict_every == 0:
                        append_line(self._conflict_line(stats), self.out / CONFLICT_FILE)
                    # a signal reaches one rank or all, and only rank 0's clock counts: the ranks vote, so that
                    # they stop, and save, at the same step
                    due = self.rank == 0 and bool(minutes) and time.monotonic() - self.saved_at >= 60 * minutes
                    if due:  # asked once: the save follows when the vote is read
                        self.saved_at = time.monotonic()
                    stopping, due = votes(stop.signum or 0, due)
                    if self.step % cfg.ckpt_every == 0 or due or stopping:
                        self.save()
                    if self.step >= last_step or stopping:
                        break
            votes.close()
        if bar is not None:
            bar.close()
        learner.eval()
        if stopping:
            raise Stopped(f"{signal.Signals(stopping).name} received: checkpoint saved at step {self.step} "
                          f"of {last_step} in {self.out}; rerun the same command to resume", stopping)

    def _step(self, x: torch.Tensor, last_step: int | None = None) -> tuple[torch.Tensor, dict]:
        """One optimizer step on the input rows ``x``; (its loss, the head's monitoring values). The loss and gradients
        are judged on the device (``train/guard.py``), so a step waits for the GPU only when the verdicts are read: every
        ``check_every`` steps, at log steps and at ``last_step``."""
        self.guard.begin()
        loss, stats = self.net(x)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.guard.step(self.step + 1, loss, stats["nce"])
        self.scheduler.step()
        self.step += 1
        if self.step % self.check_every == 0 or self.step % self.cfg.log_every == 0 or self.step == last_step:
            self._check_divergence()
        return loss, stats

    def _check_divergence(self):
        """Read the divergence guard's verdicts on the steps since the last check (one host sync). A bad step stops the
        run with a message naming the step and the term (the checkpoint on disk stays the last good one), or with
        ``on_nan="skip"`` (its update was undone on the device) is counted and warned about."""
        for step, what in self.guard.bad_steps():
            if self.cfg.on_nan == "skip":
                self.skipped_steps += 1
                print(f"warning: step {step}: {what}; step skipped (--on-nan skip)", file=sys.stderr)
                continue
            kept = f"the last good checkpoint (step {self.saved_step})" if self.saved_step else "no checkpoint"
            raise UserError(f"training diverged at step {step}: {what}; {kept} is kept in {self.out}. "
                            "Lower --lr (or --kl-weight), or pass --on-nan skip to skip such steps")

    @contextlib.contextmanager
    def _naming_divergence(self):
        """A step taken after an unchecked bad one runs on non-finite weights and may fail on them (a sampler that
        refuses NaN probabilities): then the bad step is what the user hears about."""
        try:
            yield
        except Exception:
            self._check_divergence()
            raise

    def _report_skipped(self):
        """Warn about what the run skipped: non-finite steps (--on-nan skip), unreadable images."""
        if self.skipped_steps:
            print(f"warning: {self.skipped_steps} of {self.step} steps were skipped for a non-finite loss or "
                  "gradient", file=sys.stderr)
        bad = self.out / BAD_IMAGES
        if bad.exists():
            count = len(set(bad.read_bytes().splitlines()))
            print(f"warning: {count} unreadable images were skipped; they are listed in {bad}", file=sys.stderr)

    def _record(self, loss: torch.Tensor, stats: dict, epoch: int, images_per_s: float) -> dict:
        """One log line: the -ELBO per row split into its InfoNCE and KL terms, the share of feature entries
        that take part in the loss (``active``), and the gates' state (``stats``: the head's values of the step)."""
        learner = self.learner
        # the loss's gradient: the prior's arrives divided by lambda (BayesNCLHead.prior_parameters)
        prior = {id(p) for p in learner.head.prior_parameters()}
        grads = [p.grad * learner.head.model.kl_weight if id(p) in prior else p.grad
                 for p in learner.parameters() if p.grad is not None]
        rec = dict(step=self.step, epoch=epoch, lr=self.optimizer.param_groups[0]["lr"], loss=loss.item(),
                   nce=stats["nce"].item(), kl=stats["kl"].item(),
                   grad_norm=torch.nn.utils.get_total_norm(grads).item(), images_per_s=images_per_s,
                   active=stats["active"].item())
        if learner.gated:
            rec.update({k: stats[k].item() for k in ("gate_rate", "incl_min", "incl_max", "gates_open")},
                       kl_weight=float(stats["kl_weight"]), **learner.head.pulls(stats))
            if "density_target" in stats:
                rec["density_target"] = stats["density_target"].item()
        warnings = degeneracy_warnings(rec, self.cfg.proj_dim)
        if warnings:
            rec["warnings"] = warnings
            if not self._degenerate:  # every record carries them; the terminal hears once per episode
                print(f"warning: step {self.step}: " + "; ".join(warnings), file=sys.stderr, flush=True)
        self._degenerate = bool(warnings)
        return rec

    def _conflict_line(self, stats: dict) -> str:
        """One conflict.jsonl line: the InfoNCE gradient parts per dimension on this step's batch, and for
        BayesNCL each dimension's mean inclusion probability (``incl``)."""
        rec = dict(step=self.step, **conflict_record(stats["features"], self.cfg.temperature))
        if self.learner.gated:
            rec["incl"] = stats["probs"].mean(0)
        return to_json(rec)
