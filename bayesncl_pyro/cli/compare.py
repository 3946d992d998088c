"""CL, NCL, NCL+TopK and BayesNCL side by side: one recipe, the same seeds, one table.

    python experiments/compare.py --dataset cifar10 --data-dir /data/cifar10       # CPU recipe, ~3 runs
    python experiments/compare.py --dataset compositional --methods all              # generated, no files
    python experiments/compare.py --dataset cifar10 --data-dir /data/cifar10 --recipe reference \\
        --methods all --seeds 0 1 2                                                  # the paper's recipe (GPU)

The paper's CIFAR-100 comparison (NCL vs BayesNCL with STE gates, rho 0.8, lambda 3e-5: the published
setting) at the reference recipe, as many of its 200 epochs as fit in 8.5 minutes on one GPU, with CIFAR-100
in /tmp/cifar100 (torchvision's pickled batches, or JPEG folders {train,test}/<class>/):

    python experiments/compare.py --dataset cifar100 --data-dir /tmp/cifar100 --recipe reference \\
        --methods ncl,bayesncl-ste --budget-minutes 8.5 --device cuda --workers 8 --out runs/paper-cifar100

The gate estimators against each other, at the published lambda and larger ones (a lambda list runs each
BayesNCL method once per value; docs/RESULTS.md, "Is the gain Bayesian?"):

    python experiments/compare.py --dataset compositional --methods ncl,bayesncl-ste,bayesncl-relaxed,\
bayesncl-st-sampled,bayesncl-leg --kl-weight 3e-5 1e-2 1e-1 --seeds 0 1 2 --workers 1 --out runs/estimators-comp

Is a gate's gain more than sparsity? NCL+TopK at several k against the gates at several densities of open gates
(--gate-density: lambda becomes the multiplier that meets it; a prior below 1/2 so that the KL closes gates), each
judged beside TopK at its own activation rate, random masks as sparse as it, and its posterior (docs/RESULTS.md,
"At matched sparsity"):

    python experiments/compare.py --dataset compositional --methods ncl,ncl+topk,bayesncl-ste,bayesncl-leg \
        --topk 4 8 16 --gate-density 0.15 0.3 0.45 --prior-prob 0.2 --seeds 0 1 2 --workers 0 \
        --out runs/matched-comp --record docs/results/matched-comp

and its CIFAR-100 arm (CPU recipe: 10,000 training images, the small CNN, K = 256; about 12 runs of 5-10 minutes
on 2 free cores, estimated from the compositional runs' step time, not measured), in two commands: the published
STE first, whose share of open gates on the test split ("Gates on") then sets D for both gates:

    python experiments/compare.py --dataset cifar100 --data-dir /tmp/cifar100 --methods ncl,ncl+topk,bayesncl-ste \
        --topk 16 32 --seeds 0 1 --workers 0 --out runs/matched-cifar100 --record docs/results/matched-cifar100
    python experiments/compare.py --dataset cifar100 --data-dir /tmp/cifar100 \
        --methods ncl,ncl+topk,bayesncl-ste,bayesncl-leg --topk 16 32 --prior-prob 0.2 --gate-density D \
        --seeds 0 1 --workers 0 --out runs/matched-cifar100 --record docs/results/matched-cifar100

Each method and seed trains into <out>/<method>-seed<k>/ with experiments/run_svi.py's Trainer and is
evaluated the same way (eval.json), with the recipe's evaluation protocol: the paper's (linear probe on raw
backbone features with the reference's optimizer and lr, retrieval on the strongest dims) for --recipe
reference on CIFAR and ImageNet-100, the fast one (standardised features, one lr) for the CPU recipe;
--eval-protocol overrides it. Every table names the protocol that produced it. Rerunning the command
reuses finished runs and resumes interrupted ones; a folder holding a run with other settings is an error,
never mixed in.
Writes <out>/comparison.md, comparison.json, consistency_vs_probe.png and matched_sparsity.png (consistency and
LP@1 against the activation rate, one curve per method). NCL and CL runs ignore --prior-prob and --kl-weight (they
have no gates), so their records serve comparisons at any prior.

--budget-minutes M fits the whole command after start-up (timing, training, evaluation) in about M
minutes: it first trains each method for a few steps and evaluates one of them, timing both, then trains
every run for the largest number of epochs (at most --epochs, by default the recipe's) that fits what is
left, with the recipe's share of warm-up epochs, so that the learning-rate schedule spans the epochs
trained. The plan is kept in <out>/budget.json: rerunning the command reuses it (and the finished runs).
Where the paper publishes numbers for the dataset (CIFAR-10, CIFAR-100, ImageNet-100: docs/METHOD.md,
"Published numbers"), comparison.md prints them beside ours.

--recipe cpu (the default) keeps the dataset's recipe where it is already a CPU one (digits,
compositional) and otherwise replaces ResNet-18 + LARS by the small-budget recipe (docs/METHOD.md, "At a
small budget"): a 4-block CNN, at most 10,000 training images, 15 epochs, SGD lr 0.06 with cosine, batch
256, evaluated with the fast protocol.
"""

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import one_line_errors
from bayesncl_pyro.config import DATASET_DEFAULTS, EVAL_PROTOCOLS, Config
from bayesncl_pyro.data import DATASETS
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.matched import MATCHED_COLUMNS, family, plot_matched, topk_at_rate
from bayesncl_pyro.infer.estimators import GATES
from bayesncl_pyro.train.resolve import resolve

METHOD_NAMES = ("cl", "ncl", "ncl+topk", *(f"bayesncl-{g}" for g in GATES))
DEFAULT_METHODS = "cl,ncl,bayesncl-ste"
CPU_RECIPE = dict(encoder="cnn", epochs=15, optimizer="sgd", lr=0.06, warmup_epochs=1, batch_size=256,
                  eval_protocol="fast")
CPU_SUBSET = 10_000

# (column, eval key, scale, format): fractions are shown in percent as in the paper's tables
COLUMNS = [("Cons.", "semantic_consistency", 100, ".2f"), ("H_s", "semantic_entropy", 1, ".3f"),
           ("Act.", "activation_rate", 100, ".2f"), ("LP@1", "linear_probe_top1", 100, ".2f"),
           ("LP@5", "linear_probe_top5", 100, ".2f"), ("kNN", "knn_top1", 100, ".2f"),
           ("P@1", "retrieval_p@1", 100, ".2f"), ("P@3", "retrieval_p@3", 100, ".2f"),
           ("P@5", "retrieval_p@5", 100, ".2f"), ("P@10", "retrieval_p@10", 100, ".2f"),
           ("Sparsity", "sparsity", 100, ".2f"), ("Eff. rank", "effective_rank", 1, ".3f"),
           ("Dims", "active_dims", 1, ".0f"), ("Gates on", "gates_open", 100, ".1f"),
           ("Train s", "train_time_s", 1, ".0f")]
# The paper's numbers (docs/METHOD.md, "Published numbers": ResNet-18, 200 epochs on CIFAR, 100 on ImageNet-100,
# the reference's evaluation protocol), in the units of COLUMNS: dataset -> method -> eval key -> value. The paper's
# "BayesNCL (GS)" trained the reference's loss, which is gs-reference-kl here (gs takes the KL at q's own probability)
_CONS, _HS, _LP, _GS = "semantic_consistency", "semantic_entropy", "linear_probe_top1", "bayesncl-gs-reference-kl"
PAPER = {
    "cifar10": {"cl": {_CONS: 10.00, _LP: 87.88}, "ncl": {_CONS: 53.82, _LP: 87.80}, "ncl+topk": {_CONS: 51.81},
                _GS: {_CONS: 53.68}, "bayesncl-ste": {_CONS: 56.50, _LP: 88.02}},
    "cifar100": {"cl": {_CONS: 1.00, _LP: 59.72}, "ncl": {_CONS: 9.91, _LP: 60.67}, "ncl+topk": {_CONS: 12.32},
                 _GS: {_CONS: 20.75}, "bayesncl-ste": {_CONS: 22.02, _LP: 60.69}},
    "in100": {"cl": {_CONS: 1.00, _HS: 4.59, _LP: 68.31}, "ncl": {_CONS: 14.93, _HS: 3.28, _LP: 69.63},
              "ncl+topk": {_CONS: 14.27, _HS: 3.35}, _GS: {_CONS: 11.66, _HS: 3.36},
              "bayesncl-ste": {_CONS: 36.14, _HS: 2.10, _LP: 70.44}},
}
METHOD_DOC = 'docs/METHOD.md, section "Published numbers"'  # in the repository; comparison.md points there
# --budget-minutes: steps each method is timed for, the first ones (loader start, kernel autotuning) not
# counted; the share of the budget planned for, the rest kept for what the plan misses (each run's first
# steps, checkpoints, the conflict diagnostics)
TIMING_STEPS, TIMING_SKIP, BUDGET_USE = 25, 5, 0.9
# the gate estimators' experiment: what the gates add, and the objective itself on the test split (eval.json's
# test_* keys: -ELBO from draws of q, whatever the estimator trained with)
OBJECTIVE_COLUMNS = [("Cons.", "semantic_consistency", 100, ".2f"), ("Cons. ungated", "semantic_consistency_ungated", 100, ".2f"),
                     ("Gates on", "gates_open", 100, ".1f"), ("LP@1", "linear_probe_top1", 100, ".2f"),
                     ("test -ELBO", "test_neg_elbo", 1, ".4f"), ("E_q InfoNCE", "test_nce", 1, ".4f"),
                     ("InfoNCE at F", "test_nce_mode", 1, ".4f"), ("KL per row", "test_kl", 1, ".3f")]
FACTOR_COLUMNS = [("bg dims (F)", "dims_tracking_background", 1, ".1f"),
                  ("class dims (F)", "dims_tracking_class", 1, ".1f"),
                  ("bg dims (ungated)", "ungated_dims_tracking_background", 1, ".1f"),
                  ("bg dims gated off %", "gated_off_share_background", 100, ".1f"),
                  ("class dims gated off %", "gated_off_share_class", 100, ".1f")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="cifar10", help=f"one of {', '.join(DATASETS)} (default: %(default)s)")
    p.add_argument("--data-dir", help="dataset folder, as for run_svi.py")
    p.add_argument("--out", help="comparison folder (default: runs/compare-<dataset>)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma-separated, from {', '.join(METHOD_NAMES)}, or 'all' (default: %(default)s)")
    p.add_argument("--priors", default="bernoulli",
                   help="comma-separated gate priors from the registry; each BayesNCL method runs once per prior "
                   "(default: %(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="default: %(default)s")
    p.add_argument("--recipe", choices=("cpu", "reference"), default="cpu",
                   help="cpu: small CNN, subset, 15 epochs (see above); reference: the dataset's recipe "
                   "(default: %(default)s)")
    p.add_argument("--record", type=Path, help="a folder of finished runs' records (config.json, eval.json, "
                   "log.jsonl of each, and the comparison), such as docs/results/NAME: a run recorded there with the "
                   "same configuration is reused without training, and every finished run is recorded there after")
    p.add_argument("--budget-minutes", type=float, help="fit timing, training and evaluation of every run in "
                   "about this many minutes by choosing the number of epochs, at most --epochs (see above)")
    g = p.add_argument_group("shared settings (override the recipe; default: recipe)")
    for flag, kind in (("encoder", str), ("train-subset", int), ("epochs", int), ("batch-size", int),
                       ("optimizer", str), ("lr", float), ("warmup-epochs", float), ("proj-hidden", int),
                       ("proj-dim", int), ("image-size", int), ("max-steps", int), ("prior-prob", float)):
        g.add_argument(f"--{flag}", type=kind)
    g.add_argument("--kl-weight", type=float, nargs="+", help="lambda; several values run each BayesNCL method "
                   "once per value, named <method>-lambda<value>")
    g.add_argument("--eval-protocol", choices=EVAL_PROTOCOLS, help="linear probe and retrieval: fast or reference "
                   "(the paper's; default: reference for --recipe reference on CIFAR and ImageNet-100, else fast)")
    g.add_argument("--gate-density", type=float, nargs="+", help="a target share of open gates (lambda follows "
                   "it from --kl-weight); each BayesNCL method runs once per value, named <method>-d<D>")
    g.add_argument("--topk", type=int, nargs="+", help="k of NCL+TopK (default: proj-dim / 8); several values run "
                   "NCL+TopK once per k, named ncl+topk-k<k>")
    g.add_argument("--workers", type=int, default=2)
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    return p


def method_configs(methods: list[str], priors: list[str], topk: int | list[int],
                   kl_weights: list[float] | None = None, densities: list[float] | None = None) -> dict[str, dict]:
    """Run name -> the Config fields that make that method; BayesNCL once per prior and, given several
    ``kl_weights``, once per lambda (one lambda is a shared setting), and once per density in ``densities`` (named
    <method>-d<D> even for one: a density target makes another method than a fixed lambda); NCL+TopK once per k
    given several."""
    made = {}
    several = lambda values: values if values and len(values) > 1 else [None]  # noqa: E731
    topks = topk if isinstance(topk, list) else [topk]
    for m in methods:
        if m.startswith("bayesncl-"):
            for prior, lam, d in itertools.product(priors, several(kl_weights), densities or [None]):
                name = (m if prior == "bernoulli" else f"{m}+{prior}") + ("" if lam is None else f"-lambda{lam:g}") \
                    + ("" if d is None else f"-d{d:g}")
                made[name] = dict(method="bayesncl", gate=m.removeprefix("bayesncl-"), prior=prior,
                                  **({} if lam is None else {"kl_weight": lam}),
                                  **({} if d is None else {"gate_density": d}))
        elif m == "ncl+topk" and len(topks) > 1:
            made.update({f"ncl+topk-k{k}": dict(method="ncl", topk=k) for k in topks})
        else:
            made[m] = dict(method="cl") if m == "cl" else dict(method="ncl", topk=topks[0] if m == "ncl+topk" else 0)
    return made


def shared_config(args, train_size: int) -> tuple[dict, list[str]]:
    """The Config fields every method shares, and notes on what departs from the reference recipe."""
    fields = {f.name for f in dataclasses.fields(Config)}
    shared = {k: v for k, v in vars(args).items()
              if k in fields and v is not None and k not in ("out", "topk", "kl_weight", "gate_density")}
    if args.kl_weight and len(args.kl_weight) == 1:
        shared["kl_weight"] = args.kl_weight[0]
    notes = []
    if args.recipe == "cpu" and DATASET_DEFAULTS[args.dataset]["encoder"] != "cnn":
        shared = {**CPU_RECIPE, **shared}
        if train_size > CPU_SUBSET:
            shared.setdefault("train_subset", CPU_SUBSET)
        notes.append("CPU recipe, not the paper's: " + ", ".join(f"{k}={v}" for k, v in CPU_RECIPE.items()
                                                                   if shared[k] == v))
    if shared.get("encoder") == "cnn":
        notes.append("small encoder: the 4-block CNN, not ResNet-18")
    if "train_subset" in shared:
        notes.append(f"trained on a random subset of {shared['train_subset']} of the {train_size} training images "
                     "(the test split is whole)")
    if "max_steps" in shared:
        notes.append(f"training stopped after {shared['max_steps']} steps (a smoke run)")
    return shared, notes


def budget_epochs(left_s: float, fixed_s: float, epoch_s: float, max_epochs: int, budget_minutes: float) -> int:
    """The most epochs (at most ``max_epochs``) whose training, ``epoch_s`` seconds each, fits ``BUDGET_USE`` of
    ``left_s`` seconds besides ``fixed_s`` (building and evaluating the runs); a UserError if not one does."""
    epochs = min(max_epochs, math.floor((BUDGET_USE * left_s - fixed_s) / epoch_s))
    if epochs < 1:
        raise UserError(f"--budget-minutes {budget_minutes:g} is too short: one epoch of every run takes "
                        f"{epoch_s / 60:.1f} min and building and evaluating them {fixed_s / 60:.1f} min, with "
                        f"{left_s / 60:.1f} min left after timing; raise it, or train on fewer images (--train-subset)")
    return epochs


def recipe(args) -> dict:
    """The recipe's settings before any flag overrides them: the dataset's, or the CPU recipe."""
    base = DATASET_DEFAULTS[args.dataset]
    return {**base, **CPU_RECIPE} if args.recipe == "cpu" and base["encoder"] != "cnn" else dict(base)


def plan_budget(args, shared: dict, configs: dict[str, dict], out: Path, started: float) -> dict:
    """Time a few training steps of each method and one evaluation, then choose the epochs that fit
    ``--budget-minutes`` (``budget_epochs``), at most --epochs or the recipe's. The plan is kept in
    <out>/budget.json and reused by a rerun with the same settings, so that its runs keep their configuration."""
    from bayesncl_pyro.evaluate.heldout import evaluate
    from bayesncl_pyro.train.trainer import Trainer

    max_epochs = args.epochs or recipe(args)["epochs"]
    key = dict(budget_minutes=args.budget_minutes, max_epochs=max_epochs, runs=list(configs), seeds=args.seeds,
               shared={k: v for k, v in shared.items() if k not in ("epochs", "warmup_epochs")})
    path = out / "budget.json"
    if path.exists() and json.loads(path.read_text())["key"] == key:
        plan = json.loads(path.read_text())
        print(f"reusing the plan in {path}: {plan['epochs']} epochs", flush=True)
        return plan
    step_s, build_s, eval_s = {}, {}, None
    with tempfile.TemporaryDirectory() as tmp:
        for name, fields in configs.items():
            print(f"== timing {name}: {TIMING_STEPS} steps", flush=True)
            tic = time.perf_counter()
            # the schedule does not change a step's time: no warm-up, which might outlast --epochs
            cfg = Config(**{**shared, **fields, "seed": args.seeds[0], "out": f"{tmp}/{name}", "epochs": max_epochs,
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
    left = 60 * args.budget_minutes - (time.perf_counter() - started)
    seeds = len(args.seeds)
    fixed = seeds * sum(build_s[name] + eval_s for name in configs)
    epoch = seeds * steps_per_epoch * sum(step_s.values())
    epochs = budget_epochs(left, fixed, epoch, max_epochs, args.budget_minutes)
    plan = dict(key=key, epochs=epochs, max_epochs=max_epochs, steps_per_epoch=steps_per_epoch, step_s=step_s,
                build_s=build_s, eval_s=eval_s, left_s=left, planned_s=fixed + epochs * epoch)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2) + "\n")
    return plan


def paper_table(dataset: str, summary: dict, protocol: str) -> str:
    """Our means, evaluated by ``protocol``, beside the paper's numbers (evaluated by the reference's protocol)
    for the metrics it publishes on ``dataset``; "" if none. Each column header names its protocol."""
    paper = PAPER.get(dataset, {})
    keys = [c for c in COLUMNS if any(c[1] in numbers for numbers in paper.values())]
    if not keys:
        return ""
    head = ["Method"] + [f"{name} {who}" for name, *_ in keys for who in (f"(ours, {protocol})", "(paper, reference)")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, stats in summary.items():
        cells = [method]
        for _, key, scale, fmt in keys:
            cells.append(f"{stats[key][0] * scale:{fmt}}" if key in stats else "")
            theirs = paper.get(method, {}).get(key)
            cells.append("" if theirs is None else f"{theirs:{fmt}}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def train_time(run_dir: Path, batch_size: int) -> float:
    """Seconds spent in training steps, summed from log.jsonl (each line's images / images_per_s); steps
    replayed after a resume are counted once."""
    by_step = {rec["step"]: rec["images_per_s"] for rec in rundir.read_log(run_dir)}
    total, last = 0.0, 0
    for step in sorted(by_step):
        total += (step - last) * batch_size / by_step[step]
        last = step
    return total


def mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def summarise(runs: list[dict], keys: list[str]) -> dict:
    """Method -> {key: [mean, std]} over its seeds, for the keys its runs have."""
    out = {}
    for run in runs:
        out.setdefault(run["name"], [])
        out[run["name"]].append(run)
    return {name: {k: list(mean_std([r[k] for r in rs])) for k in keys if all(k in r for r in rs)}
            for name, rs in out.items()}


def table(summary: dict, columns: list, seeds: int) -> str:
    head = ["Method"] + [c[0] for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, stats in summary.items():
        cells = [name]
        for _, key, scale, fmt in columns:
            if key not in stats:
                cells.append("")
                continue
            m, s = stats[key]
            cells.append(f"{m * scale:{fmt}}" + (f" ± {s * scale:{fmt}}" if seeds > 1 else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    names = list(dict.fromkeys(r["name"] for r in runs))
    for i, name in enumerate(names):
        rs = [r for r in runs if r["name"] == name]
        ax.scatter([100 * r["linear_probe_top1"] for r in rs], [100 * r["semantic_consistency"] for r in rs],
                   label=name, color=f"C{i}")
    ax.set_xlabel("linear probe top-1 (%)")
    ax.set_ylabel("semantic consistency (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(args) -> dict:
    from bayesncl_pyro.data import load_dataset
    from bayesncl_pyro.evaluate.heldout import describe_protocol
    from bayesncl_pyro.train.trainer import Trainer

    methods = METHOD_NAMES if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHOD_NAMES]
    if unknown:
        raise UserError(f"unknown --methods {', '.join(unknown)}; choose from {', '.join(METHOD_NAMES)} or 'all'")
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        raise UserError(f"--budget-minutes must be positive, got {args.budget_minutes:g}")
    started = time.perf_counter()
    out = Path(args.out or f"runs/compare-{args.dataset}")
    train_size = len(load_dataset(args.dataset, args.data_dir).train)
    shared, notes = shared_config(args, train_size)
    proj_dim = shared.get("proj_dim") or DATASET_DEFAULTS[args.dataset]["proj_dim"]
    configs = method_configs(methods, args.priors.split(","), args.topk or max(1, proj_dim // 8), args.kl_weight,
                             args.gate_density)
    plan = None
    if args.budget_minutes is not None:
        plan = plan_budget(args, shared, configs, out, started)
        shared["epochs"] = plan["epochs"]
        if args.warmup_epochs is None:  # the recipe's share of warm-up epochs
            shared["warmup_epochs"] = recipe(args)["warmup_epochs"] * plan["epochs"] / recipe(args)["epochs"]
        notes.append(f"{plan['epochs']} epochs (at most {plan['max_epochs']}), the most that fit "
                     f"--budget-minutes {args.budget_minutes:g} (timed: " + ", ".join(
                         f"{n} {1e3 * t:.0f} ms/step" for n, t in plan["step_s"].items())
                     + f", evaluation {plan['eval_s']:.0f} s); warm-up {shared.get('warmup_epochs'):g} epochs")
    runs, settings = [], None
    for name, fields in configs.items():
        for seed in args.seeds:
            run_dir = out / f"{name}-seed{seed}"
            # the gates' settings are BayesNCL's alone: NCL and CL runs keep the defaults, so a comparison at another
            # prior reuses their records
            own = {k: v for k, v in shared.items() if fields["method"] == "bayesncl" or k not in GATE_SETTINGS}
            cfg = resolve(Config(**own, **fields, seed=seed, out=str(run_dir)))
            recorded = args.record and recorded_run(args.record / run_dir.name, cfg)
            if recorded:
                print(f"== {name}, seed {seed}: recorded in {args.record / run_dir.name}", flush=True)
                run_dir = args.record / run_dir.name
                results = rundir.read_eval(run_dir, cfg.gate)
            else:
                print(f"== {name}, seed {seed} -> {run_dir}", flush=True)
                results = Trainer(cfg).fit().evaluate()
                if args.record:
                    record(run_dir, args.record / run_dir.name)
            runs.append(dict(name=name, family=family(fields), seed=seed, folder=run_dir.name, **results,
                             train_time_s=train_time(run_dir, cfg.batch_size)))
            if settings is None or (cfg.method == "bayesncl" and settings.method != "bayesncl"):
                settings = cfg  # the gates' shared settings, where there are gates
    runs = topk_at_rate(runs)
    keys = list(dict.fromkeys(c[1] for c in COLUMNS + OBJECTIVE_COLUMNS + FACTOR_COLUMNS + MATCHED_COLUMNS))
    summary = summarise(runs, keys)
    per_run = {"method", "gate", "prior", "topk", "seed", "gate_density"} | (
        {"kl_weight"} if len(args.kl_weight or ()) > 1 else set())
    settings = {k: v for k, v in settings.identity().items() if k not in per_run}
    protocol = ", ".join(sorted({r["protocol"] for r in runs}))  # one: it is a shared setting
    report = dict(dataset=args.dataset, seeds=args.seeds, protocol=protocol, notes=notes, settings=settings,
                  summary=summary, runs=runs, paper=PAPER.get(args.dataset, {}), budget=plan,
                  wall_s=time.perf_counter() - started)
    out.mkdir(parents=True, exist_ok=True)  # every run may have come from --record
    (out / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, out / "consistency_vs_probe.png")
    plot_matched(runs, out / "matched_sparsity.png")
    md = [f"# {args.dataset}: " + " vs ".join(summary), "",
          *(f"- {n}" for n in notes),
          "- evaluation protocol " + describe_protocol(protocol, args.dataset),
          f"- seeds {args.seeds}" + (" (mean ± std)" if len(args.seeds) > 1 else "") + "; metrics on the test split, "
          "in percent except H_s (nats), effective rank (nats), Dims and train seconds", "",
          table(summary, COLUMNS, len(args.seeds))]
    if any("test_neg_elbo" in r for r in runs):
        md += ["", "What the gates add (Cons. of the same model with every gate open) and the objective on the test "
               "split, per row, whatever each run trained: -ELBO = E_q[InfoNCE] + lambda * KL, from 8 draws of "
               "q(g | x) per batch of the training batch size and the exact KL (at each run's own lambda); E_q "
               "InfoNCE, its likelihood term (comparable across runs and lambdas); InfoNCE at F, at the evaluation "
               "mask (the mode).", "", table(summary, OBJECTIVE_COLUMNS, len(args.seeds))]
    if any(FACTOR_COLUMNS[0][1] in r for r in runs):
        md += ["", "Dimensions by the ground-truth factor they track (bg = background). (F): in the evaluated "
               "representation; ungated: BayesNCL's features before its gates; gated off: share of the dims that "
               "the gates close in most samples where they fire.", "", table(summary, FACTOR_COLUMNS, len(args.seeds))]
    if any("topk_semantic_consistency_at_rate" in r or "semantic_consistency_random_mask" in r for r in runs):
        md += ["", "At matched sparsity (matched_sparsity.png): each run's consistency and dims tracking the class "
               "beside NCL+TopK's at the same activation rate of F and at the same sparsity (linear in it between "
               "the two nearest k, "
               "each the mean over its seeds, NCL as k = K; blank outside their range), the same run's ungated "
               "features under random masks as sparse as F (the mean of 5), and the run judged as a posterior: at "
               "q's mean (soft gating) and over 5 draws from q. LP@1 is on backbone features, one per run.", "",
               table(summary, MATCHED_COLUMNS, len(args.seeds))]
    paper = paper_table(args.dataset, summary, protocol)
    if paper:
        caveat = "" if protocol == "reference" else (", so our LP@1 is not measured as the paper's is (--eval-protocol "
                                                     "reference, in another --out, measures it so)")
        md += ["", f"Beside the paper's numbers ({METHOD_DOC}: ResNet-18 at the full recipe, 200 epochs on CIFAR, "
               f"100 on ImageNet-100, evaluated by the reference protocol); ours evaluated by the {protocol} "
               f"protocol{caveat}:", "", paper]
    md += ["", "Shared settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
           f"Wall time of this command: {report['wall_s'] / 60:.1f} min", ""]
    (out / "comparison.md").write_text("\n".join(md))
    if args.record:
        for name in ("comparison.md", "comparison.json"):
            shutil.copyfile(out / name, args.record / name)
    print("\n".join(md))
    return report


GATE_SETTINGS = ("prior_prob", "kl_weight")  # shared flags that only BayesNCL runs read
RECORD = (rundir.CONFIG, rundir.EVAL, rundir.LOG)  # what --record keeps of a run: kilobytes, no checkpoint


def recorded_run(folder: Path, cfg: Config) -> bool:
    """Whether ``folder`` records a finished run of ``cfg``'s configuration (``--record``)."""
    if not all((folder / name).exists() for name in RECORD):
        return False
    return not Config.from_dict(json.loads((folder / rundir.CONFIG).read_text())).differences(cfg)


def record(run_dir: Path, folder: Path):
    """Copy a finished run's record into ``folder`` (``--record``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in RECORD:
        shutil.copyfile(run_dir / name, folder / name)


@one_line_errors
def main(argv=None) -> int:
    compare(parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
