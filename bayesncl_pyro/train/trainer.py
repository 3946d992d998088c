"""The training loop: dataset -> augment -> encoder -> (model, guide) -> -ELBO -> optimizer; then the evaluation.

One ``Trainer`` owns a run folder (``rundir`` lists its files and does the writing and reading): ``fit()`` trains
it to the last step, ``evaluate()`` evaluates the finished run. Running the same command again in the same folder
resumes from ``checkpoint.pt``; a finished run is not retrained (its results are printed again), and one made by
another number of processes continues.
SIGINT, SIGTERM and SIGUSR1 stop it at a step boundary with a checkpoint; a SIGKILL loses at most the steps
since the last one. ``docs/RELIABILITY.md`` lists every fault handled and what the user sees.
"""

import contextlib
import logging
import math
import random
import signal
import sys
import time
from pathlib import Path

import pyro
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bayesncl_pyro import distributed, rundir
from bayesncl_pyro._version import __version__
from bayesncl_pyro.config import Config
from bayesncl_pyro.data import DataSpec, image_files, load_dataset
from bayesncl_pyro.data.pipeline import TrainingInput
from bayesncl_pyro.device import pick_device
from bayesncl_pyro.errors import Stopped, UserError
from bayesncl_pyro.evaluate import heldout
from bayesncl_pyro.evaluate.diagnostics import conflict_record, degeneracy_warnings, to_json
from bayesncl_pyro.infer.density import shortfall
from bayesncl_pyro.infer.head import HeadOutput
from bayesncl_pyro.infer.learner import ContrastiveLearner, load_weights
from bayesncl_pyro.loggers import RunLog
from bayesncl_pyro.nn.optim import (
    build_optimizer,
    build_scheduler,
    load_optimizer_state,
    load_scheduler_state,
    rescale_prior_group,
)
from bayesncl_pyro.rundir import (
    BAD_IMAGES,
    CHECKPOINT,
    CONFIG,
    CONFLICT,
    EVAL,
    LOG,
    TEXT_LIMIT,
    append_line,
    atomic_save,
    cut_records,
    read_bytes,
    write_json,
)
from bayesncl_pyro.train.graph import StepGraph
from bayesncl_pyro.train.guard import CHECK_EVERY, DivergenceGuard, StopRequest
from bayesncl_pyro.train.monitor import Monitor
from bayesncl_pyro.train.resolve import resolve

logger = logging.getLogger(__name__)


class Trainer:
    """Trains one run and evaluates it: ``Trainer(cfg).fit().evaluate()`` returns the evaluation dict.

    Building it sets up the run of ``cfg`` in its run folder (``cfg.out``): it claims the folder, resumes the run
    there from its checkpoint, or starts one.

    Examples:
        Two steps on the digits, then the evaluation (it prints its table; about 8 s on a CPU):

        >>> cfg = Config(dataset="digits", max_steps=2, batch_size=64, proj_dim=16, workers=0, out=folder)
        >>> results = Trainer(cfg, progress=False).fit().evaluate()  # doctest: +ELLIPSIS
        step=2 epoch=0 ...
        >>> results["method"], 0 <= results["linear_probe_top1"] <= 1
        ('bayesncl', True)

    Args:
        cfg: the run's configuration.
        progress: a bar on stderr rather than printed lines (default: when stderr is a terminal).
        overwrite: move whatever the run folder holds into a ``previous-<time>`` subfolder and start afresh, instead
            of resuming the run there or refusing one with another config.
        data: the images to train on, in place of the config's dataset (``bench_step.py``'s steps on generated
            images of any recipe).

    Raises:
        UserError: the run folder holds another run (another config) or something that is not a run, or a
            setting cannot be used here.
    """

    def __init__(self, cfg: Config, progress: bool | None = None, overwrite: bool = False,
                 data: DataSpec | None = None):
        self.cfg = cfg = resolve(cfg)
        self.out = Path(cfg.out)
        self.rank, self.world, self.device = distributed.setup(pick_device(cfg.device))
        if cfg.batch_size % self.world:
            raise UserError(f"--batch-size {cfg.batch_size} (the global batch) does not split evenly over "
                            f"{self.world} processes; pick a multiple of {self.world}")
        self._lock = None  # rank 0's lock on the run folder, held while the trainer lives
        if self.rank == 0:
            self._lock = rundir.claim(self.out, cfg, overwrite)
        try:
            self._set_up(cfg, progress, data)
        except BaseException:  # refused before it wrote a file: the corrected command finds no folder of this one
            if self._lock is not None:
                rundir.unclaim(self.out, self._lock)
                self._lock = None
            raise

    def _set_up(self, cfg: Config, progress: bool | None, data: DataSpec | None):
        """Everything of ``__init__`` after the claim of the run folder: data, learner, optimizer, checkpoint, log."""
        distributed.barrier()
        pyro.set_rng_seed(cfg.seed)
        self.data = data or load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, skip_bad=cfg.skip_bad_images,
                                         train_subset=cfg.train_subset, holdout=cfg.holdout_cells)
        # the rows every rank gathers each step follow from these, and the steps and checkpoints of all
        distributed.check_agreement(dict(cfg.identity(), max_steps=cfg.max_steps, ckpt_every=cfg.ckpt_every,
                                         training_images=len(self.data.train)))
        for split in (image_files(self.data.train), image_files(self.data.test)):
            if split is not None:  # image files: every loader worker appends what it skips here
                split.bad_log = self.out / BAD_IMAGES
        # channels_last: the layout cuDNN's tensor-core convolutions want
        self.memory_format = torch.channels_last if self.device.type == "cuda" else torch.preserve_format
        self.input = TrainingInput(self.data, cfg, self.device, self.rank, self.world, self.memory_format)
        if len(self.data.train) < cfg.batch_size:
            raise UserError(f"--batch-size {cfg.batch_size} is larger than the training set "
                            f"({len(self.data.train)} images); lower it")
        self.learner = ContrastiveLearner(cfg, self.data.channels, len(self.data.train)).to(
            self.device, memory_format=self.memory_format)
        if self.world > 1 and self.device.type == "cuda":  # a host sync per layer and step (docs/PERFORMANCE.md)
            self.learner = nn.SyncBatchNorm.convert_sync_batchnorm(self.learner)
        self.test_features = None  # the evaluation's pass over the test split, which the gate export reads too
        if self.rank:  # same initial weights everywhere, then each rank its own gate noise
            pyro.set_rng_seed(cfg.seed + 1_000_003 * self.rank)
        self.steps_per_epoch = len(self.data.train) // cfg.batch_size
        self.total_steps = cfg.epochs * self.steps_per_epoch
        self.last_step = self.total_steps if cfg.max_steps is None else min(self.total_steps, cfg.max_steps)
        if cfg.cuda_graphs and self.device.type != "cuda":
            raise UserError(f"--cuda-graphs captures the training step on a CUDA GPU, and this run is on "
                            f"{self.device}: drop --cuda-graphs")
        if cfg.cuda_graphs and self.world > 1:
            raise UserError("--cuda-graphs runs on one GPU (DDP's gradient all-reduce and SyncBatchNorm's host syncs "
                            "are not captured): drop it under torchrun")
        self.optimizer = build_optimizer(cfg.optimizer, self.learner.param_groups(), cfg.momentum,
                                         cfg.weight_decay, lr_on_device=cfg.cuda_graphs)
        self.scheduler = build_scheduler(self.optimizer, round(cfg.warmup_epochs * self.steps_per_epoch),
                                         self.total_steps)
        self.step = self.saved_step = self.skipped_steps = 0
        self.finished = False
        self._stop = StopRequest()
        self._degenerate = False
        self._threads_logged = False  # the first log record of this process says torch's thread count
        self._last_record = None  # this process's last log record: the density warning reads its pulls
        self._load_checkpoint()
        self.evaluated = self.finished and (self.out / EVAL).exists()  # this very model's: a rerun prints it again
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
        self._step = StepGraph(self._eager_step) if cfg.cuda_graphs else self._eager_step
        self.log, self.monitor = None, None
        if self.rank == 0:  # set up without a refusal: the folder is this run's now
            # what a killed run logged past its checkpoint is logged again
            past = {records: cut_records(self.out / records, self.step) for records in (LOG, CONFLICT)}
            # the thread count with the settings: a run's float sums, and so its numbers, depend on it
            write_json(dict(cfg.to_dict(), num_threads=torch.get_num_threads()), self.out / CONFIG)
            bar = sys.stderr.isatty() if progress is None else progress
            # a finished run evaluated before has nothing left to log: no TensorBoard or W&B run is started
            self.log = RunLog(self.out, cfg, bar, trackers=not self.evaluated, step=self.step, rewind=past[LOG])
            if cfg.monitor_every:
                self.monitor = Monitor(self.learner, self.data, cfg, self.device)

    def state_dict(self) -> dict:
        """The checkpoint's contents.

        Returns:
            The config, step, learner, optimizer and scheduler states, and every rank's RNG states.
        """
        return dict(version=__version__, config=self.cfg.to_dict(), step=self.step, finished=self.finished,
                    num_train=len(self.data.train), channels=self.data.channels,
                    learner=self.learner.state_dict(), optimizer=self.optimizer.state_dict(),
                    scheduler=self.scheduler.state_dict(), skipped_steps=self.skipped_steps,
                    rng=distributed.all_gather_objects(  # one entry per rank
                        dict(torch=torch.get_rng_state(), python=list(random.getstate()[1]),
                             cuda=torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)))

    def save(self):
        """Write the checkpoint: rank 0 writes the file, every rank waits until it is written.

        Every rank calls this (it gathers their RNG states), and no rank goes on (or exits: torchrun then stops the
        others) before the file is written. A step not yet checked for divergence is checked first: no checkpoint holds
        a bad step.
        """
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
        rescale_prior_group(state["optimizer"], state["scheduler"], state["config"]["kl_weight"],
                            state["config"]["optimizer"])
        try:
            load_optimizer_state(self.optimizer, state["optimizer"])
        except ValueError as e:
            raise UserError(f"{path} holds an optimizer state this run cannot take: {e}; it was not written by this "
                            "run's code: move it away (a rerun then trains from the start)") from None
        load_scheduler_state(self.scheduler, state["scheduler"])
        self.step = state["step"]
        if len(state["rng"]) == self.world:
            rng = state["rng"][self.rank]
            own = torch.get_rng_state()
            if not (torch.is_tensor(rng["torch"]) and rng["torch"].dtype == own.dtype
                    and rng["torch"].shape == own.shape):
                raise UserError(f"{path} holds a random-number state that is not torch's (a {own.dtype} tensor of "
                                f"{own.numel()} bytes): move it away (a rerun then trains from the start)")
            torch.set_rng_state(rng["torch"])
            random.setstate((3, tuple(rng["python"]), None))
            if self.device.type == "cuda":
                self._restore_cuda_rng(rng["cuda"], path)
        else:  # each process's own streams cannot be split or merged: every rank starts one from (seed, step, rank)
            pyro.set_rng_seed(((self.cfg.seed * 1_000_003 + self.step) * 1_009 + self.rank) % 2**32)
            if self.rank == 0:
                logger.warning(f"note: {path} was written by {len(state['rng'])} process(es), this run has "
                               f"{self.world}: the global batch ({self.cfg.batch_size}), data order and schedule "
                               "continue; gate noise and device-drawn views come from per-process random streams, "
                               "which restart, so the numbers differ from an uninterrupted run's")
        # a run finished at --max-steps trains on when rerun with a larger one (a finished evaluation stays until the
        # new one replaces it)
        self.finished = state["finished"] and self.step >= self.last_step
        self.saved_step, self.skipped_steps = self.step, state.get("skipped_steps", 0)

    def _restore_cuda_rng(self, saved: torch.Tensor | list | None, path: Path):
        """Continue the CUDA random stream (gate noise) of the GPU that wrote the checkpoint on this run's GPU.

        Whatever its index. ``saved``: that GPU's state; None from a run on the CPU; in older checkpoints a list of the
        states of every GPU that process saw, of which this device's index is taken.
        """
        if isinstance(saved, list):
            index = self.device.index
            if saved and index >= len(saved):
                logger.warning(f"note: {path} holds the CUDA random states of {len(saved)} GPU(s), none for "
                               f"{self.device}: its CUDA random stream (gate noise) restarts, so the numbers differ "
                               "from an uninterrupted run's")
            saved = saved[index] if index < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(saved, self.device)

    # -- training -----------------------------------------------------------------------------
    def fit(self) -> "Trainer":
        """Train to the last step, save the finished run, then ``evaluate()``.

        The last step is ``--max-steps``, else the end of ``--epochs``; a finished run is not trained again.

        Returns:
            The trainer itself, so that ``Trainer(cfg).fit().evaluate()`` reads as one line.

        Raises:
            Stopped: a signal (Ctrl-C) came during training: the checkpoint is saved, the same command resumes.
        """
        if self.finished:
            return self
        with self._stop as stop:  # a signal during the last step or the final write is noted, never lost or raised
            if self.step < self.last_step:
                self.train(self.last_step)
            self.finished = True
            self.save()
        if stop.signum:  # no collective follows: each rank can act on its own
            raise Stopped(f"{signal.Signals(stop.signum).name} received: training finished, checkpoint saved at step "
                          f"{self.step} in {self.out}; rerun the same command to evaluate it", stop.signum)
        return self

    def evaluate(self) -> dict:
        """The finished run's evaluation (rank 0's; the others get {}).

        It is written to eval.json, given to the trackers and printed; that of a run evaluated before is read back and
        printed again.

        Returns:
            eval.json's dict (its keys: docs/run_folder.md, "eval.json, key by key").
        """
        if self.evaluated:
            results = rundir.read_eval(self.out, self.cfg.gate)
            if self.rank == 0:
                print(f"{self.out} already holds a finished run; its results (pass another --out to train again):")
                print(heldout.format_table(results))
            return results
        if self.rank:
            return {}
        progress = self.log.progress()
        self.test_features = heldout.test_features(self.learner, self.data, self.device, progress)
        results = heldout.evaluate(self.learner, self.data, self.cfg, self.device, progress, self.test_features)
        write_json(results, self.out / EVAL)
        self.evaluated = True
        self.log.evaluation(results, self.step)
        self.log.close()
        print(heldout.format_table(results))
        missed = shortfall(self.cfg.gate_density, results.get("gates_open"), self._last_record)
        if missed:
            logger.warning(missed)
        self._report_skipped()
        return results

    def train(self, last_step: int):
        """The steps up to ``last_step``, with a checkpoint every ``--ckpt-every`` steps and ``--ckpt-minutes`` minutes.

        A stop request (a signal, on any rank) ends them at once with a checkpoint and ``Stopped``.

        Args:
            last_step: the step to train to (the run's step count after it).
        """
        self.learner.train()
        votes, stopping = distributed.Votes(), 0
        self.saved_at = time.monotonic()  # rank 0's clock decides --ckpt-minutes; nothing is unsaved yet
        progress = self.log.training(self.step, last_step) if self.log else contextlib.nullcontext()
        with pyro.validation_enabled(False), self._stop as stop, self._naming_divergence(), progress:
            for x in self.input.batches(self.step, last_step):
                loss, out = self.train_step(x, last_step)
                if self.log:
                    self._log(loss, out, last_step)
                # a signal reaches one rank or all, and only rank 0's clock counts: the ranks vote, so that they
                # stop, and save, at the same step
                stopping, due = votes(stop.signum or 0, self._checkpoint_due())
                if self.step % self.cfg.ckpt_every == 0 or due or stopping:
                    self.save()
                if stopping:
                    break
            votes.close()
        self.learner.eval()
        if stopping:
            raise Stopped(f"{signal.Signals(stopping).name} received: checkpoint saved at step {self.step} "
                          f"of {last_step} in {self.out}; rerun the same command to resume", stopping)

    def train_step(self, x: torch.Tensor, last_step: int | None = None) -> tuple[torch.Tensor, HeadOutput]:
        """One optimizer step on the input rows ``x``.

        The divergence guard (``train/guard.py``) judges the loss and gradients on the device, so a step waits for the
        GPU only when its verdicts are read: every ``check_every`` steps, at log steps and at ``last_step``.

        Args:
            x: the step's input, 2B rows on the device: [view 1; view 2] of the batch's B images.
            last_step: the run's last step, where the guard's verdict is read whatever the step.

        Returns:
            The step's loss (0-d) and the head's monitoring values (:class:`~bayesncl_pyro.infer.output.HeadOutput`).
        """
        loss, out = self._step(x)
        self.guard.keep(self.step + 1)
        self.scheduler.step()
        self.step += 1
        if self.step % self.check_every == 0 or self.step % self.cfg.log_every == 0 or self.step == last_step:
            self._check_divergence()
        return loss, out

    def _eager_step(self, x: torch.Tensor) -> tuple[torch.Tensor, HeadOutput]:
        """What a CUDA graph captures of a step (``--cuda-graphs``; ``train/graph.py``): the same work at every call.

        The forward and backward passes, the divergence guard's verdict, the optimizer step and the density target's
        update of lambda.
        """
        self.guard.begin()
        loss, out = self.net(x)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        with self.guard.judge(loss, out.nce):  # with --on-nan skip, a bad step is undone
            self.optimizer.step()
        self.learner.head.update_density(out)
        return loss, out

    def _log(self, loss: torch.Tensor, out: HeadOutput, last_step: int):
        """Rank 0's records of the step just taken: log.jsonl and conflict.jsonl lines when due.

        A log.jsonl line every --log-every steps and at the last (its own rows' loss, an unbiased estimate of the global
        one: reading it syncs with the GPU, so only then), with the monitor's figures every --monitor-every epochs but
        at the last (the evaluation that follows has the whole data's kNN); a conflict.jsonl line every --conflict-every
        steps.
        """
        cfg, step = self.cfg, self.step
        self.log.step()
        monitor = (self.monitor is not None and step % (cfg.monitor_every * self.steps_per_epoch) == 0
                   and step < last_step)
        if step % cfg.log_every == 0 or step == last_step or monitor:
            rec = self._record(loss, out, self.log.images_per_s())
            if monitor:  # outside the time images_per_s measures
                rec.update(self.monitor())
            self.log.record(rec, out.probs.mean(0) if self.learner.gated else None)
        if cfg.conflict_every and step % cfg.conflict_every == 0:
            append_line(self._conflict_line(out), self.out / CONFLICT)

    def _checkpoint_due(self) -> bool:
        """Rank 0's vote for a --ckpt-minutes checkpoint, cast once: the save follows when the votes are read."""
        minutes = self.cfg.ckpt_minutes
        if self.rank or not minutes or time.monotonic() - self.saved_at < 60 * minutes:
            return False
        self.saved_at = time.monotonic()
        return True

    def _check_divergence(self):
        """Read the divergence guard's verdicts on the steps since the last check (one host sync).

        A bad step stops the run with a message naming the step and the term (the checkpoint on disk stays the last good
        one), or with ``on_nan="skip"`` (its update was undone on the device) is counted and warned about.
        """
        for step, what in self.guard.bad_steps():
            if self.cfg.on_nan == "skip":
                self.skipped_steps += 1
                logger.warning(f"warning: step {step}: {what}; step skipped (--on-nan skip)")
                continue
            kept = f"the last good checkpoint (step {self.saved_step})" if self.saved_step else "no checkpoint"
            raise UserError(f"training diverged at step {step}: {what}; {kept} is kept in {self.out}. "
                            "Lower --lr (or --kl-weight), or pass --on-nan skip to skip such steps")

    @contextlib.contextmanager
    def _naming_divergence(self):
        """Name an unchecked bad step when a step taken after it fails.

        A step taken after an unchecked bad one runs on non-finite weights and may fail on them (a sampler that refuses
        NaN probabilities): then the bad step is what the user hears about.
        """
        try:
            yield
        except Exception:
            self._check_divergence()
            raise

    def _report_skipped(self):
        """Warn about what the run skipped: non-finite steps (--on-nan skip), unreadable images."""
        if self.skipped_steps:
            logger.warning(f"warning: {self.skipped_steps} of {self.step} steps were skipped for a non-finite loss "
                           "or gradient")
        bad = self.out / BAD_IMAGES
        if bad.exists():
            count = len(set(read_bytes(bad, TEXT_LIMIT).splitlines()))
            logger.warning(f"warning: {count} unreadable images were skipped; they are listed in {bad}")

    def _record(self, loss: torch.Tensor, out: HeadOutput, images_per_s: float) -> dict:
        """One log line: the -ELBO per row split into its InfoNCE and KL terms, with the active share and the gates.

        ``active``: the share of feature entries that take part in the loss; ``out``: what the head computed in the
        step, the gates' state among it.
        """
        learner = self.learner
        epoch = (self.step - 1) // self.steps_per_epoch  # the epoch of the step's batch
        rec = dict(step=self.step, epoch=epoch, lr=float(self.optimizer.param_groups[0]["lr"]), loss=loss.item(),
                   nce=out.nce.item(), kl=out.kl.item(),
                   grad_norm=self._grad_norm(out), images_per_s=images_per_s,
                   active=out.active.item())
        if not self._threads_logged:
            rec["num_threads"], self._threads_logged = torch.get_num_threads(), True
        if learner.gated:
            rec.update({k: getattr(out, k).item() for k in ("gate_rate", "incl_min", "incl_max", "gates_open")},
                       kl_weight=float(out.kl_weight), **learner.head.pulls(out))
            density = learner.head.density
            if density is not None:  # the target the step's dual update aimed at, and the step's multiplier
                rec.update(density_target=density.target.item(), density_multiplier=out.density_multiplier.item())
        warnings = degeneracy_warnings(rec, self.cfg.proj_dim)
        if warnings:
            rec["warnings"] = warnings
            if not self._degenerate:  # every record carries them; the terminal hears once per episode
                logger.warning(f"warning: step {self.step}: " + "; ".join(warnings))
        self._degenerate = bool(warnings)
        self._last_record = rec
        return rec

    def _grad_norm(self, out: HeadOutput) -> float:
        """The 2-norm of the step's loss gradient, from the guard's norms of the parameters' (float64).

        The prior's arrive divided by the step's lambda (``BayesNCLHead.prior_parameters``) and are put back on the
        loss's scale.
        """
        prior = {id(p) for p in self.learner.head.prior_parameters()}
        weight = float(out.kl_weight) if prior else 1.0
        return math.hypot(*(n * weight if id(p) in prior else n
                            for p, n in zip(self.guard.params, self.guard.grad_norms(), strict=True)))

    def _conflict_line(self, out: HeadOutput) -> str:
        """One conflict.jsonl line: the InfoNCE gradient parts per dimension on this step's batch.

        For BayesNCL also each dimension's mean inclusion probability (``incl``).
        """
        rec = dict(step=self.step, **conflict_record(out.features, self.cfg.temperature))
        if self.learner.gated:
            rec["incl"] = out.probs.mean(0)
        return to_json(rec)
