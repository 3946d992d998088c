r"""Training-step throughput of CL, NCL and BayesNCL, and what the Pyro layer costs.

    python experiments/bench_step.py                                  # CPU, digits recipe (small CNN)
    python experiments/bench_step.py --device cuda --dataset in100 --batch-size 512 --memory-batches 128,256,512
    python experiments/bench_step.py --device cuda --dataset in100 --data-dir /data/in100 --workers 16 \
        --pipeline-batches 50                    # + data pipeline and end to end, views drawn in workers and on the GPU
    python experiments/bench_step.py --count-ops  # the device views' aten calls and host time per batch, then stop

Variants, each one optimizer step (forward, backward, SGD) on the same synthetic batch already on the device:
  cl, ncl, bayesncl   the learner as training runs it (Pyro program, MeanFieldELBO; ste gates)
  bayesncl_tmf        the same program through Pyro's stock TraceMeanField_ELBO
  bayesncl_plain      the same maths written directly in PyTorch (no Pyro)
  bayesncl_st-sampled, bayesncl_leg   the learner with the gate estimators that follow the ELBO
Before timing, the three BayesNCL variants are checked to give the same loss and gradients. The FLOPs of one
step (matmuls and convolutions, counted on the meta device, so any recipe is counted without running it) are
printed with the leg estimator's own work, which is elementwise (its flip differences: see leg_flops).

Every repeat runs each variant for one untimed step and ``--steps`` (1) timed ones, in turn, in an order reversed at
every repeat, and ratios are taken within a repeat, then the median over the ``--repeats`` (40) repeats; that is one
run, and ``--runs`` (5) runs, each but the first a process of its own, give the median over runs (on 2 CPU cores one
run's Pyro/plain moves by about 0.01 from process to process): on a shared machine the ratios are meaningful,
absolute times less so. The three BayesNCL variants train one learner, so they time the same weights in the same
memory.

Then the trainer's own step without the data pipeline (``--trainer-batches``, 50: the divergence guard and the schedule
included; ``--cuda-graphs`` captures it): wall and host CPU time per batch, and on a GPU its time between two events.
"""

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import TraceMeanField_ELBO
from torch.utils.flop_counter import FlopCounterMode

from bayesncl_pyro.config import OPTIMIZERS, Config
from bayesncl_pyro.device import pick_device
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.head import own_params
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.nn.losses import bernoulli_kl, info_nce_rows, normalize
from bayesncl_pyro.train.resolve import resolve


def plain_loss(learner: ContrastiveLearner, x: torch.Tensor) -> torch.Tensor:
    """The BayesNCL loss for the Bernoulli prior, written without Pyro.

    ``learner(x)[0]``: InfoNCE + lambda * KL, mean per row (the zero-safe ``normalize``: an all-zero gated row gets no
    gradient, where ``F.normalize`` would give it 1e12).
    """
    model, guide, estimator = learner.model, learner.guide, learner.head.estimator
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=learner.cfg.amp and x.is_cuda):
        h = learner.backbone(x)
        z = learner.head.projector(h)
    h, z = h.float(), z.float()
    u, kl = model.features(z), 0.0
    if guide is not None:
        q = guide.posterior(h)
        u = normalize(u * estimator.value(q))
        kl = bernoulli_kl(estimator.kl_probs(q), model.prior.rate(), estimator.kl_clamp).sum(1).mean()
    return info_nce_rows(u, model.temperature).mean() + model.kl_weight * kl


def stock_loss(learner: ContrastiveLearner, x: torch.Tensor) -> torch.Tensor:
    """The BayesNCL loss through Pyro's stock ``TraceMeanField_ELBO``.

    ``learner(x)[0]`` on the head's program, with the per-step work that ``bayesncl_pyro/infer/elbo.py`` leaves out.
    """
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=learner.cfg.amp and x.is_cuda):
        h = learner.backbone(x)
        z = learner.head.projector(h)
    model, guide = learner.head.training_program()
    with own_params():
        return TraceMeanField_ELBO().differentiable_loss(model, guide, z.float(), h.float()) / learner.head.num_rows


def loss_fns(cfg: Config, channels: int, device: torch.device) -> dict:
    """Variant name -> (loss function of a batch, the learner it trains)."""
    fns = {}
    for method in ("cl", "ncl", "bayesncl"):
        learner = ContrastiveLearner(resolve(Config(**{**cfg.to_dict(), "method": method})), channels, 50_000)
        fns[method] = (lambda x, m=learner: m(x)[0], learner)
    # the three ways of computing BayesNCL's loss on one learner: the same weights in the same memory, where two
    # learners' layouts alone made their steps differ by up to 1 % within a process
    bayes = fns["bayesncl"][1]
    fns["bayesncl_tmf"] = (lambda x: stock_loss(bayes, x), bayes)
    fns["bayesncl_plain"] = (lambda x: plain_loss(bayes, x), bayes)
    for gate in ("st-sampled", "leg"):
        learner = ContrastiveLearner(resolve(Config(**{**cfg.to_dict(), "method": "bayesncl", "gate": gate})),
                                     channels, 50_000)
        fns[f"bayesncl_{gate}"] = (lambda x, m=learner: m(x)[0], learner)
    for name, (_, learner) in fns.items():  # every run's ratios from the same weights, not only the checked run's
        if name.startswith("bayesncl") and learner is not bayes:
            learner.load_state_dict(bayes.state_dict())
    mf = torch.channels_last if device.type == "cuda" else torch.preserve_format
    for learner in learners(fns):
        learner.to(device, memory_format=mf).train()
    return fns


def learners(fns: dict) -> list[ContrastiveLearner]:
    """The variants' learners, each once (the three BayesNCL variants share one)."""
    return list({id(learner): learner for _, learner in fns.values()}.values())


def check_equal(fns: dict, x: torch.Tensor):
    """The BayesNCL variants give the same loss and gradients from the same weights and gate noise."""
    ref = fns["bayesncl_tmf"][1].state_dict()
    results = {}
    for name in ("bayesncl_tmf", "bayesncl_plain", "bayesncl"):
        fn, learner = fns[name]
        learner.load_state_dict(ref)
        learner.zero_grad()
        pyro.set_rng_seed(0)
        loss = fn(x)
        loss.backward()
        results[name] = loss.detach().float(), [p.grad.float() for p in learner.parameters() if p.grad is not None]
    tol = dict(rtol=1e-4, atol=1e-5) if x.device.type == "cpu" else dict(rtol=2e-2, atol=1e-3)  # bf16 on GPU
    for name in ("bayesncl_plain", "bayesncl"):
        torch.testing.assert_close(results[name][0], results["bayesncl_tmf"][0], **tol)
        for a, b in zip(results[name][1], results["bayesncl_tmf"][1], strict=True):
            torch.testing.assert_close(a, b, **tol)


def check_float64(cfg: Config, channels: int, x: torch.Tensor):
    """Check the device's float32 and autocast loss against a float64 CPU reference.

    The BayesNCL loss and gate probabilities in float32 and under the autocast training uses (the backbone, the
    projector and the gating head's MLP in bf16), against a float64 CPU reference on the same weights and the first 16
    images of the batch (STE gates: deterministic on every device).
    """
    b, n = x.shape[0] // 2, min(x.shape[0] // 2, 16)
    x = torch.cat([x[:n], x[b:b + n]])
    learner = ContrastiveLearner(resolve(dataclasses.replace(cfg, method="bayesncl", gate="ste")), channels, 50_000)
    expected, expected_stats = copy.deepcopy(learner).double()(x.cpu().double())
    learner.to(x.device)
    # float32 on a GPU uses TF32 convolutions (cuDNN's default; matmuls stay float32): about 1e-3 relative
    tolerances = {"float32": 1e-5 if x.device.type == "cpu" else 5e-3}
    if x.is_cuda and cfg.amp:
        tolerances["bf16 autocast"] = 5e-2
    for name, tol in tolerances.items():
        learner.cfg = dataclasses.replace(learner.cfg, amp=name != "float32")
        got, stats = learner(x)
        rel = abs(got.item() - expected.item()) / abs(expected.item())
        probs = (stats.probs.cpu().double() - expected_stats.probs).abs().max().item()
        print(f"check: {x.device.type} {name} loss {got.item():.6f} vs CPU float64 {expected.item():.6f}: relative "
              f"difference {rel:.1e}; gate probabilities differ by at most {probs:.1e} (tolerance {tol:.0e} for both)")
        if not (rel <= tol and probs <= tol):
            raise SystemExit(f"error: the {x.device.type} {name} loss or gate probabilities are off the float64 "
                             "reference")


def sync(device: torch.device):
    """Wait for the device's queued work (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(fn, opt, x: torch.Tensor, steps: int) -> float:
    """Seconds per optimizer step."""
    sync(x.device)
    tic = time.perf_counter()
    for _ in range(steps):
        loss = fn(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    sync(x.device)
    return (time.perf_counter() - tic) / max(steps, 1)


def step_flops(fn, x: torch.Tensor) -> int:
    """Floating-point operations of one forward and backward (matmuls and convolutions, as PyTorch counts)."""
    with FlopCounterMode(display=False) as counter:
        fn(x).backward()
    return counter.get_total_flops()


def recipe_flops(cfg: Config, channels: int) -> dict[str, int]:
    """FLOPs of one forward and backward of NCL and BayesNCL, counted on the meta device.

    At the recipe ``cfg`` (no arithmetic runs: an ImageNet-100 step is counted on any machine). The Pyro program is left
    out (its work is InfoNCE's R x R matmul, counted for both, and the KL's elementwise terms).
    """
    out = {}
    x = torch.empty(2 * cfg.batch_size, channels, cfg.image_size, cfg.image_size, device="meta")
    for method in ("ncl", "bayesncl"):
        method_cfg = resolve(dataclasses.replace(cfg, method=method, device="cpu"))
        learner = ContrastiveLearner(method_cfg, channels, 50_000).to("meta")

        def step(x, backbone=learner.backbone, head=learner.head):
            h = backbone(x)
            u = normalize(head.projector(h))
            loss = (u @ u.T).logsumexp(1).sum()
            return loss + head.guide.logits(h).sum() if head.gated else loss

        out[method] = step_flops(step, x)
    return out


def leg_flops(rows: int, dims: int) -> int:
    """The leg estimator's FLOPs per step beyond ste's.

    One FLOP per elementwise operation (it is elementwise, which PyTorch's counter does not count): two R x R x K
    matmuls (the gated rows' similarities and dot products) and, for each of the R K flips (a GPU computes every one)
    and each of the R rows, nine operations (``losses.info_nce_flip_differences``: the new similarity's multiply-add and
    scaling, its exp, the softmax weight's multiply, subtraction and log1p, two sums).
    """
    return 2 * 2 * rows * rows * dims + 9 * rows * dims * rows


def peak_memory(fn, opt, x: torch.Tensor) -> float:
    """GiB of GPU memory at the peak of one step."""
    torch.cuda.reset_peak_memory_stats(x.device)
    time_steps(fn, opt, x, 1)
    return torch.cuda.max_memory_allocated(x.device) / 2**30


def parser() -> argparse.ArgumentParser:
    """The command line of experiments/bench_step.py."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="digits", help="recipe for the defaults below, and the data of the "
                   "pipeline figure (default: %(default)s)")
    p.add_argument("--data-dir", help="dataset folder, for the pipeline figure of file-based datasets")
    p.add_argument("--device", default="cpu", help="cpu, cuda (the current GPU) or cuda:N (default: %(default)s)")
    p.add_argument("--encoder", help="default: the dataset's")
    p.add_argument("--image-size", type=int, help="default: the dataset's")
    p.add_argument("--batch-size", type=int, help="images per step (two views each); default: the dataset's")
    p.add_argument("--proj-hidden", type=int, help="default: the dataset's")
    p.add_argument("--proj-dim", type=int, help="default: the dataset's")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="no bf16 autocast of the encoder on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile the encoders (CUDA)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per variant and repeat (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=40, help="interleaved repeats, the variants' order reversed at each "
                   "(default: %(default)s)")
    p.add_argument("--runs", type=int, default=5, help="timing runs, each a process of its own (one CPU run's ratios "
                   "move by a few %%): the figures are the median over runs (default: %(default)s)")
    p.add_argument("--times-to", help=argparse.SUPPRESS)  # a run of --runs: its times, as JSON, to this file
    p.add_argument("--trainer-batches", type=int, default=50, help="batches through the trainer's own step (guard, "
                   "schedule, --cuda-graphs) without the pipeline, timed on the host and the GPU, 0 = skip "
                   "(default: %(default)s)")
    p.add_argument("--cuda-graphs", action="store_true", help="the trainer step as a CUDA graph (with --optimizer "
                   "lars or adamw)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, help="the trainer step's; default: the dataset's")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default: %(default)s)")
    p.add_argument("--memory-batches", default="", help="comma-separated batch sizes: peak GPU memory of a "
                   "BayesNCL step at each (CUDA)")
    p.add_argument("--pipeline-batches", type=int, default=0, help="batches for the data-pipeline-only and the "
                   "end-to-end figures, 0 = skip (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="data-loading processes (default: %(default)s)")
    p.add_argument("--augment", choices=("workers", "device", "both"), default="both", help="where the pipeline "
                   "figures draw the views: loader workers, batched on the device, or both and their ratio "
                   "(default: %(default)s)")
    p.add_argument("--count-ops", action="store_true", help="only count the device views' aten calls and time their "
                   "host work per batch (count_view_ops), on the CPU")
    return p


def main(argv=None) -> int:
    """Run the benchmarks the flags ask for and print their figures."""
    args = parser().parse_args(argv)
    if args.count_ops:
        return count_view_ops()
    try:
        device = pick_device(args.device)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = resolve(Config(dataset=args.dataset, encoder=args.encoder, image_size=args.image_size,
                         batch_size=args.batch_size, proj_hidden=args.proj_hidden, proj_dim=args.proj_dim,
                         amp=args.amp, device=args.device, workers=args.workers, optimizer=args.optimizer))
    channels = 1 if cfg.dataset == "digits" else 3
    torch.manual_seed(0)
    x = torch.randn(2 * cfg.batch_size, channels, cfg.image_size, cfg.image_size, device=device)
    if device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    fns = loss_fns(cfg, channels, device)
    print(f"torch {torch.__version__}, pyro {pyro.__version__}, {device_name(device)}; {cfg.encoder} at "
          f"{cfg.image_size} px, batch {cfg.batch_size} images ({2 * cfg.batch_size} rows), K={cfg.proj_dim}, "
          f"amp={cfg.amp and device.type == 'cuda'}, compile={args.compile}")

    with pyro.validation_enabled(False):
        if args.times_to:  # one of the timing runs of --runs
            Path(args.times_to).write_text(json.dumps(measure(fns, x, args)))
            return 0
        check_float64(cfg, channels, x)
        # at kl_clamp=0: the clamp is the head's ELBO's argument, and the stock ELBO takes the registered KL
        check_equal(loss_fns(dataclasses.replace(cfg, kl_clamp=0.0), channels, device), x)
        print("check: BayesNCL loss and gradients equal for MeanFieldELBO, TraceMeanField_ELBO and plain PyTorch "
              "(exact KL)")
        runs = [measure(fns, x, args)]
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(1, args.runs):  # each a process of its own: the first run's memory and state stay here
                out = Path(tmp) / f"run{i}.json"
                subprocess.run([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--runs", "1",
                                "--times-to", str(out)], check=True, stdout=subprocess.DEVNULL)
                runs.append(json.loads(out.read_text()))
        opts = {name: torch.optim.SGD(learner.parameters(), lr=1e-3) for name, (_, learner) in fns.items()}
        report(runs, cfg.batch_size)
        flops = recipe_flops(cfg, channels)
        # the time ratio cannot go below this: the gating head's own matmuls
        print(f"BayesNCL/NCL FLOPs per step:                     {flops['bayesncl'] / flops['ncl']:.3f}")
        leg = leg_flops(2 * cfg.batch_size, cfg.proj_dim)
        print(f"leg/ste FLOPs per step (elementwise counted):    {(flops['bayesncl'] + leg) / flops['bayesncl']:.4f}"
              f" ({leg / 1e9:.2f} GFLOP of flip differences, {flops['bayesncl'] / 1e9:.1f} GFLOP for the step)")
        if device.type == "cuda":
            print("\npeak GPU memory of one step (GiB):",
                  ", ".join(f"{n} {peak_memory(fn, opts[n], x):.2f}" for n, (fn, _) in fns.items()))
            for b in filter(None, args.memory_batches.split(",")):
                xb = torch.randn(2 * int(b), *x.shape[1:], device=device).contiguous(
                    memory_format=torch.channels_last)
                gib = peak_memory(fns["bayesncl"][0], opts["bayesncl"], xb)
                print(f"peak GPU memory, BayesNCL, batch {b}: {gib:.2f} GiB")
        if args.trainer_batches:
            trainer_steps(cfg, args, channels, device)
        if args.pipeline_batches:
            pipeline(cfg, args, device)
    return 0


def measure(fns: dict, x: torch.Tensor, args) -> dict[str, list[float]]:
    """Seconds per step of each variant in each of ``--repeats`` rounds, the variants interleaved within a round.

    A round is short (one step of each variant by default) and its order the last one's reversed: the ratio of two
    variants within a round is then taken a few milliseconds apart, and neither always runs first (on 2 CPU cores a
    paired step resolves the Pyro layer's 1-3 %, where blocks of 5 steps each moved by several %).
    """
    if args.compile:
        for learner in learners(fns):
            learner.backbone.compile()
    opts = {name: torch.optim.SGD(learner.parameters(), lr=1e-3) for name, (_, learner) in fns.items()}
    for name, (fn, _) in fns.items():
        time_steps(fn, opts[name], x, args.warmup)
    times = {name: [] for name in fns}
    order = list(fns)
    for _ in range(args.repeats):
        for name in order:
            # one untimed step first: the step after another variant's runs on the caches that one left, a cost no
            # training run pays (it never switches) and a larger one for the variant with more Python to run
            time_steps(fns[name][0], opts[name], x, 1)
            times[name].append(time_steps(fns[name][0], opts[name], x, args.steps))
        order.reverse()  # each variant as often before as after each other: no drift or cache order favours one
    return times


def trainer_steps(cfg: Config, args, channels: int, device: torch.device):
    """Time the trainer's own step without the data pipeline.

    ``Trainer.train_step`` (the divergence guard, the schedule, and with ``--cuda-graphs`` the step's CUDA graph)
    without the data pipeline: ``--trainer-batches`` steps of BayesNCL at the recipe on one batch of generated images
    held on the device, after ``--warmup`` steps (with --cuda-graphs, at least its 3 eager steps and the capture). Per
    batch: wall time, the host's CPU time (the training thread's), and on a GPU the time between two events on its
    stream.
    """
    from bayesncl_pyro.data import DataSpec, TensorImages
    from bayesncl_pyro.train.graph import WARMUP_STEPS
    from bayesncl_pyro.train.trainer import Trainer

    images = torch.randint(0, 256, (2 * cfg.batch_size, channels, cfg.image_size, cfg.image_size), dtype=torch.uint8)
    data = DataSpec(TensorImages(images, [0] * len(images)), TensorImages(images[:2], [0, 0]), ["generated"], channels)
    with tempfile.TemporaryDirectory() as out:
        try:
            trainer = Trainer(Config(**{**cfg.to_dict(), "method": "bayesncl", "out": out, "log_every": 10**9,
                                        "ckpt_every": 10**9, "monitor_every": 0, "conflict_every": 0,
                                        "compile": args.compile, "cuda_graphs": args.cuda_graphs}),
                              progress=False, data=data)
        except UserError as err:
            print(f"\n(the trainer step: {err})")
            return
        x = next(iter(trainer.input.batches(0, 1)))
        for _ in range(max(args.warmup, WARMUP_STEPS + 1 if args.cuda_graphs else 0)):
            trainer.train_step(x)
        n = args.trainer_batches
        sync(device)
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if device.type == \
            "cuda" else (None, None)
        if start:
            start.record()
        wall, host = time.perf_counter(), time.thread_time()
        for _ in range(n):
            trainer.train_step(x)
        host = time.thread_time() - host
        if end:
            end.record()
        sync(device)
        wall = time.perf_counter() - wall
        gpu = f", GPU {start.elapsed_time(end) / n:.2f} ms (events)" if start else ""
        print(f"\ntrainer step, no pipeline (BayesNCL, cuda_graphs={args.cuda_graphs}, {n} batches): "
              f"{1e3 * wall / n:.2f} ms per batch, host CPU {1e3 * host / n:.2f} ms{gpu}; "
              f"{n * cfg.batch_size / wall:.1f} images/s")


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU with its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


RATIOS = {"Pyro/plain step time, MeanFieldELBO (training):  ": ("bayesncl", "bayesncl_plain"),
          "Pyro/plain step time, stock TraceMeanField_ELBO:": ("bayesncl_tmf", "bayesncl_plain"),
          "BayesNCL/NCL step time:                         ": ("bayesncl", "ncl"),
          "st-sampled/ste step time:                       ": ("bayesncl_st-sampled", "bayesncl"),
          "leg/ste step time:                              ": ("bayesncl_leg", "bayesncl"),
          "NCL/CL step time:                               ": ("ncl", "cl")}


def report(runs: list[dict], batch: int):
    """Print per variant the median time and ratios over runs.

    Per variant, the median over runs of each run's median time; each ratio, the median over runs of each run's median
    over its repeats of the ratio within a repeat (with several runs, each run's figure follows).
    """
    def ratio(times, a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    print(f"\n{'variant':16} {'ms/step':>9} {'images/s':>10}"
          + (f"   (median of {len(runs)} runs)" if len(runs) > 1 else ""))
    for name in runs[0]:
        t = statistics.median(statistics.median(times[name]) for times in runs)
        print(f"{name:16} {1e3 * t:9.2f} {batch / t:10.1f}")
    print()
    for label, (a, b) in RATIOS.items():
        each = [ratio(times, a, b) for times in runs]
        print(f"{label} {statistics.median(each):.3f}" + (f"  (runs: {', '.join(f'{r:.3f}' for r in each)})"
                                                          if len(runs) > 1 else ""))


def pipeline(cfg: Config, args, device: torch.device):
    """Images/s of the training data pipeline alone, then end to end.

    The pipeline alone (read, decode, two augmented views, on the device), then end to end: the same pipeline feeding
    BayesNCL training steps (on CUDA the device path draws the next batch while a step runs). Once per place the views
    are drawn (``--augment``): in the loader workers, and batched on the device, of the training set held there
    (``resident``: in-memory sets, folders of small images of one size) or of each batch's files.
    """
    from bayesncl_pyro.data import pipeline as P
    from bayesncl_pyro.train.trainer import Trainer

    n = args.pipeline_batches

    def run(trainer: Trainer, step: bool) -> float:
        inputs = trainer.input.batches(0, n + 2)  # the first epoch's first n + 2 steps
        for i, x in enumerate(inputs):  # the first batches wait for the workers (or the thread) to start
            if i == 2:
                sync(device)
                tic = time.perf_counter()
            if step:
                trainer.train_step(x)  # the training step, divergence guard included
        sync(device)
        return n * cfg.batch_size / (time.perf_counter() - tic)

    paths = ("workers", "device") if args.augment == "both" else (args.augment,)
    figures = {}
    with tempfile.TemporaryDirectory() as out:
        for path in paths:
            trainer = Trainer(Config(**{**cfg.to_dict(), "method": "bayesncl", "data_dir": args.data_dir,
                                        "out": f"{out}/{path}", "augment": path, "log_every": 10**9,
                                        "ckpt_every": 10**9, "compile": args.compile}), progress=False)
            if len(trainer.data.train) < (n + 2) * cfg.batch_size:
                print(f"\n(the pipeline figures need {(n + 2) * cfg.batch_size} training images; "
                      f"{args.dataset} has {len(trainer.data.train)})")
                return
            where = {type(None): "workers", P.ResidentViews: "device, training set held there",
                     P.FileViews: "device, files decoded per batch"}[type(trainer.input.views)]
            figures[path] = run(trainer, False), run(trainer, True)
            print(f"\n{path} augmentation ({where}; {args.workers} workers): data pipeline only "
                  f"{figures[path][0]:.1f} images/s, end to end (BayesNCL) {figures[path][1]:.1f} images/s, "
                  f"end to end / pipeline {figures[path][1] / figures[path][0]:.2f}")
            if trainer.input.views is not None:
                with producer_costs(trainer) as costs:
                    run(trainer, False)
                print(costs[0])
    if len(figures) == 2:
        (pipe_w, end_w), (pipe_d, end_d) = figures["workers"], figures["device"]
        print(f"device/workers images/s: data pipeline only {pipe_d / pipe_w:.2f}, end to end {end_d / end_w:.2f}")


# ------------------------------------------------------------------------------------------- the device views


@contextlib.contextmanager
def producer_costs(trainer):
    """Context manager that times the device views' producer per batch.

    After the block: ``[line]`` saying its median CPU time per batch (``time.thread_time`` of the thread that draws
    them: the training thread for a set held on the GPU, whose graphs it replays, the input pipeline's for files) and on
    CUDA its median GPU time per batch (events around its work on the pipeline's stream: decoding, the views; for the
    graphs, the parameters' copy and the replay).
    """
    from bayesncl_pyro.data import pipeline as P

    cuda = trainer.device.type == "cuda"
    graphs = cuda and isinstance(trainer.input.views, P.ResidentViews)
    owner, name = (P._GraphedViews, "launch") if graphs else (type(trainer.input.views), "__call__")
    original = getattr(owner, name)
    cpu, events = [], []

    def timed(self, *args, **kwargs):
        stream = (self.side if graphs else torch.cuda.current_stream()) if cuda else None
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            start.record(stream)
        tic = time.thread_time()
        out = original(self, *args, **kwargs)
        cpu.append(time.thread_time() - tic)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            events.append((start, end))
        return out

    line = []
    setattr(owner, name, timed)
    try:
        yield line
    finally:
        setattr(owner, name, original)
    sync(trainer.device)
    gpu = f", GPU {statistics.median(a.elapsed_time(b) for a, b in events):.2f} ms (events)" if events else ""
    line.append(f"views' producer per batch: CPU {1e3 * statistics.median(cpu):.2f} ms (thread_time){gpu}, median of "
                f"{len(cpu)}")


def aten_calls(fn) -> int:
    """The number of top-level aten ops ``fn()`` calls.

    As the torch profiler records them, less those called by another aten op (what a dispatcher mode sees; a compiled
    function's generated kernels are not aten calls, its library calls are).
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        count += event.name.startswith("aten::") and parent is None
    return count


def count_view_ops() -> int:
    """The device views' host work per batch, on the CPU.

    As the GPU pipeline issues it: aten calls (``aten_calls``), counted at 4 and at 8 images (the same: the ops are
    whole-batch ops), and host microseconds per batch of 2 images (median of 20) on one thread, whose arithmetic is
    small beside the calls (the files' views drawn at 40 px for that: the same calls as at 224, blur included). Two
    recipes: CIFAR's 32 px views of a training set held on the device, and ImageNet's 224 px views of decoded files of
    varied sizes. Each eager (the CPU's path; the GPU's without ``--compile``), then as the GPU pipeline draws them: the
    set held on the device as a CUDA graph, whose replay issues no aten call, so the host only draws the parameters into
    its pinned buffer and copies them over (one copy, which the CPU does not make: added); the files with the chain
    compiled (``--compile``: ``torch.compile(fullgraph=True, dynamic=False)``, compiled first). The last line gives the
    GPU pipeline's.
    """
    from bayesncl_pyro.data.device_views import BatchViews, ViewParams

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a GPU run's host issues the calls from one thread; more would split tiny ops
    resident = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8)

    def recipes(n: int, size: int, graph: bool) -> dict:
        """Per recipe, one batch of ``n`` images' views (``graph``: as the GPU pipeline draws them)."""
        rows, g = torch.randint(0, 64, (n,)), torch.Generator()
        # decoded files: ImageNet's sizes scaled to 1/8, to keep the CPU's arithmetic small
        files = [torch.randint(0, 256, (3, torch.randint(38, 47, ()).item(), torch.randint(50, 63, ()).item()),
                               dtype=torch.uint8) for _ in range(n)]
        params = ViewParams(n, 32, 3, cpu, rows=True)
        params.host[0]["sizes"].fill_(32)  # once: the set's images are of one size
        resident_views = BatchViews(n, 32, 3, cpu, rows=True)
        file_views = BatchViews(n, size, 3, cpu, compile=graph)
        return {"views-resident-32": (lambda: params.draw(g, rows=rows)) if graph else (
                    lambda: resident_views(resident, g, rows)),
                "views-files-224": lambda: file_views(files, g)}

    def warm(fns: dict) -> dict:
        for fn in fns.values():
            fn()  # and compile
        return fns

    calls = {}
    for graph in (False, True):
        counts = [{name: aten_calls(fn) for name, fn in warm(recipes(n, 224, graph)).items()} for n in (4, 8)]
        if counts[0] != counts[1]:
            raise SystemExit(f"error: the views' calls depend on the batch size: {counts}")
        calls[graph] = counts[0]
        if graph:
            calls[graph]["views-resident-32"] += 1  # the copy of the parameters to the GPU (none on the CPU)
        micros = {}
        for name, fn in warm(recipes(2, 40, graph)).items():
            times = []
            for _ in range(20):
                tic = time.perf_counter()
                fn()
                times.append(time.perf_counter() - tic)
            micros[name] = 1e6 * statistics.median(times)
        how = ("as the GPU pipeline (the set: parameters drawn, copied, a graph replayed; the files: compiled)" if graph
               else "eager (the CPU's path, and the GPU's without --compile)")
        print(f"{how}: aten calls per batch " + ", ".join(f"{k} {v}" for k, v in calls[graph].items())
              + "; host us per batch of 2 images " + ", ".join(f"{k} {v:.0f}" for k, v in micros.items()))
    print("aten calls per batch: " + " ".join(f"{k}={v}" for k, v in calls[True].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
