r"""CL, NCL, NCL+TopK and BayesNCL side by side: one recipe, the same seeds, one table.

    python experiments/compare.py --dataset cifar10 --data-dir /data/cifar10       # CPU recipe, ~3 runs
    python experiments/compare.py --dataset compositional --methods all              # generated, no files
    python experiments/compare.py --dataset cifar10 --data-dir /data/cifar10 --recipe reference \
        --methods all --seeds 0 1 2                                                  # the paper's recipe (GPU)

The paper's CIFAR-100 comparison (NCL vs BayesNCL with STE gates, rho 0.8, lambda 3e-5: the published
setting) at the reference recipe, as many of its 200 epochs as fit in 8.5 minutes on one GPU, with CIFAR-100
in /tmp/cifar100 (torchvision's pickled batches, or JPEG folders {train,test}/<class>/):

    python experiments/compare.py --dataset cifar100 --data-dir /tmp/cifar100 --recipe reference \
        --methods ncl,bayesncl-ste --budget-minutes 8.5 --device cuda --workers 8 --out runs/paper-cifar100

The gate estimators against each other, at the published lambda and larger ones (a lambda list runs each
BayesNCL method once per value; docs/RESULTS.md, "Is the gain Bayesian?"):

    python experiments/compare.py --dataset compositional \
        --methods ncl,bayesncl-ste,bayesncl-relaxed,bayesncl-st-sampled,bayesncl-leg --kl-weight 3e-5 1e-2 1e-1 \
        --seeds 0 1 2 --workers 1 --out runs/estimators-comp

Is a gate's gain more than sparsity? NCL+TopK over a grid of k against the gates at the published prior and at a density
of open gates (--gate-density: a constraint with a multiplier of its own that meets it, for any prior and rate), each
paired by seed with NCL, with TopK at its own sparsity and with its controls, on the paper's and the top-N
consistency (docs/RESULTS.md, "At matched sparsity", gives the 90 runs' cost):

    python experiments/compare.py --dataset compositional --methods ncl,ncl+topk,bayesncl-ste,bayesncl-leg \
        --topk 2 4 8 16 32 --gate-density 0.3 --prior-prob 0.2 --seeds 0 1 2 3 4 5 6 7 8 9 --workers 0 \
        --out runs/verdict-comp --record docs/results/verdict-comp
    python experiments/compare.py --dataset compositional --methods ncl,ncl+topk,bayesncl-ste \
        --topk 2 4 8 16 32 --seeds 0 1 2 3 4 5 6 7 8 9 --workers 0 --out runs/verdict-comp \
        --record docs/results/verdict-comp

and its CIFAR-100 arm (CPU recipe: 10,000 training images, the small CNN, K = 256; 12 runs of 585 steps):

    python experiments/compare.py --dataset cifar100 --data-dir /tmp/cifar100 --methods ncl,ncl+topk,bayesncl-ste \
        --topk 16 32 --seeds 0 1 2 --workers 0 --out runs/verdict-cifar100 --record docs/results/verdict-cifar100

Each method and seed trains into <out>/<method>-seed<k>/ with experiments/run_svi.py's Trainer and is
evaluated the same way (eval.json), with the recipe's evaluation protocol: the paper's (linear probe on raw
backbone features with the reference's optimizer and lr, retrieval on the strongest dims) for --recipe
reference on CIFAR and ImageNet-100, the fast one (standardised features, one lr) for the CPU recipe;
--eval-protocol overrides it. Every table names the protocol that produced it. Rerunning the command
reuses finished runs and resumes interrupted ones; a folder holding a run with other settings is an error,
never mixed in.
Writes <out>/comparison.md, comparison.json, consistency_vs_probe.png and matched_sparsity.png (consistency and
LP@1 against the activation rate, one curve per method), and paired.png (each gated method minus each baseline,
seed by seed, with its intervals, one-sided bounds, equivalence test, power and Holm-adjusted p in the tables).
A recorded comparison is rewritten from its records by today's code, without data or training:

    python experiments/compare.py --rebuild docs/results/verdict-comp/comparison-d0.3.json
 NCL and CL runs ignore --prior-prob and --kl-weight (they
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
import sys
import time
from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import ArgumentParser, one_line_errors
from bayesncl_pyro.config import DATASET_DEFAULTS, EVAL_PROTOCOLS, Config
from bayesncl_pyro.data import DATASETS
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.comparison import comparison, mismatched, rebuild, write_comparison
from bayesncl_pyro.evaluate.pairing import family
from bayesncl_pyro.train.plan import METHOD_NAMES, method_configs, record, recorded_run, shared_settings, train_time
from bayesncl_pyro.train.resolve import resolve

DEFAULT_METHODS = "cl,ncl,bayesncl-ste"
CPU_RECIPE = dict(encoder="cnn", epochs=15, optimizer="sgd", lr=0.06, warmup_epochs=1, batch_size=256,
                  eval_protocol="fast")
CPU_SUBSET = 10_000
GATE_SETTINGS = ("prior_prob", "kl_weight")  # shared flags that only BayesNCL runs read


def parser() -> argparse.ArgumentParser:
    """The command line of experiments/compare.py."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="Every list takes its values apart or comma-separated: --seeds 0 1 2 or --seeds 0,1,2, "
                       "--methods ncl bayesncl-ste or --methods ncl,bayesncl-ste.")
    p.add_argument("--dataset", default=Config().dataset, help=f"one of {', '.join(DATASETS)} (default: %(default)s, "
                   "as for run_svi.py)")
    p.add_argument("--data-dir", help="dataset folder, as for run_svi.py")
    p.add_argument("--out", help="comparison folder (default: runs/compare-<dataset>)")
    p.add_argument("--methods", nargs="+", default=[DEFAULT_METHODS],
                   help=f"from {', '.join(METHOD_NAMES)}, or 'all' (default: {DEFAULT_METHODS})")
    p.add_argument("--priors", nargs="+", default=["bernoulli"],
                   help="gate priors from the registry; each BayesNCL method runs once per prior (default: bernoulli)")
    p.add_argument("--seeds", nargs="+", default=["0"], help="default: 0")
    p.add_argument("--recipe", choices=("cpu", "reference"), default="cpu",
                   help="cpu: small CNN, subset, 15 epochs (see above); reference: the dataset's recipe "
                   "(default: %(default)s)")
    p.add_argument("--record", type=Path, help="a folder of finished runs' records (config.json, eval.json, "
                   "log.jsonl of each, and the comparison), such as docs/results/NAME: a run recorded there with the "
                   "same configuration is reused without training, and every finished run is recorded there after")
    p.add_argument("--rebuild", type=Path, metavar="JSON", help="rewrite a recorded comparison (such as "
                   "docs/results/verdict-comp/comparison-d0.3.json), its markdown and paired figures beside it from "
                   "its runs' records by today's code, without the data and without training; other flags are ignored")
    p.add_argument("--budget-minutes", type=float, help="fit timing, training and evaluation of every run in "
                   "about this many minutes by choosing the number of epochs, at most --epochs (see above)")
    g = p.add_argument_group("shared settings (override the recipe; default: recipe)")
    for flag, kind in (("encoder", str), ("train-subset", int), ("epochs", int), ("batch-size", int),
                       ("optimizer", str), ("lr", float), ("warmup-epochs", float), ("proj-hidden", int),
                       ("proj-dim", int), ("image-size", int), ("max-steps", int), ("prior-prob", float),
                       ("holdout-cells", str)):
        g.add_argument(f"--{flag}", type=kind)
    g.add_argument("--kl-weight", nargs="+", help="lambda; several values run each BayesNCL method "
                   "once per value, named <method>-lambda<value>")
    g.add_argument("--eval-protocol", choices=EVAL_PROTOCOLS, help="linear probe and retrieval: fast or reference "
                   "(the paper's; default: reference for --recipe reference on CIFAR and ImageNet-100, else fast)")
    g.add_argument("--gate-density", nargs="+", help="a target share of open gates (a constraint with "
                   "its own multiplier; lambda stays --kl-weight); each BayesNCL method runs once per value, named "
                   "<method>-d<D>")
    g.add_argument("--gate-heads", nargs="+", help="mlp and/or bayesian (docs/novelty.md); each BayesNCL method runs "
                   "once per head, a bayesian one named <method>-bayesian (default: mlp)")
    g.add_argument("--topk", nargs="+", help="k of NCL+TopK (default: proj-dim / 8); several values run "
                   "NCL+TopK once per k, named ncl+topk-k<k>")
    g.add_argument("--workers", type=int, default=2)
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    return p


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
    return shared, notes


def steps_note(shared: dict, train_size: int, dataset: str) -> str | None:
    """What --max-steps did to the runs, in words; None without it.

    It stops a run only when it comes before the schedule's last step (``--epochs`` over the training images, in
    batches), which ends the run otherwise.
    """
    if "max_steps" not in shared:
        return None
    values = {**DATASET_DEFAULTS[dataset], **shared}
    images = min(values.get("train_subset") or train_size, train_size)
    steps = values["epochs"] * (images // values["batch_size"])
    if shared["max_steps"] < steps:
        return f"training stopped after {shared['max_steps']} of its {steps} steps (--max-steps: a smoke run)"
    epochs = f"{values['epochs']} epoch{'s' if values['epochs'] != 1 else ''}"
    return (f"training ran its {steps} steps ({epochs} of {images // values['batch_size']}); "
            f"--max-steps {shared['max_steps']} stopped nothing")


def recipe(args) -> dict:
    """The recipe's settings before any flag overrides them: the dataset's, or the CPU recipe."""
    base = DATASET_DEFAULTS[args.dataset]
    return {**base, **CPU_RECIPE} if args.recipe == "cpu" and base["encoder"] != "cnn" else dict(base)


def compare(args) -> dict:
    """Train (or read from --record) every method's runs at every seed; write the comparison and return its report."""
    from bayesncl_pyro.data import load_dataset
    from bayesncl_pyro.train.budget import plan_budget
    from bayesncl_pyro.train.trainer import Trainer

    methods = METHOD_NAMES if args.methods == ["all"] else args.methods
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
    configs = method_configs(methods, args.priors, args.topk or max(1, proj_dim // 8), args.kl_weight,
                             args.gate_density, args.gate_heads)
    plan = None
    if args.budget_minutes is not None:
        plan = plan_budget(args.budget_minutes, args.epochs or recipe(args)["epochs"], shared, configs, args.seeds,
                           out, started)
        shared["epochs"] = plan["epochs"]
        if args.warmup_epochs is None:  # the recipe's share of warm-up epochs
            shared["warmup_epochs"] = recipe(args)["warmup_epochs"] * plan["epochs"] / recipe(args)["epochs"]
        notes.append(f"{plan['epochs']} epochs (at most {plan['max_epochs']}), the most that fit "
                     f"--budget-minutes {args.budget_minutes:g} (timed: " + ", ".join(
                         f"{n} {1e3 * t:.0f} ms/step" for n, t in plan["step_s"].items())
                     + f", evaluation {plan['eval_s']:.0f} s); warm-up {shared.get('warmup_epochs'):g} epochs")
    if (note := steps_note(shared, train_size, args.dataset)) is not None:
        notes.append(note)
    runs, settings = [], None
    for name, fields in configs.items():
        for seed in args.seeds:
            run_dir = out / f"{name}-seed{seed}"
            # the gates' settings are BayesNCL's alone: NCL and CL runs keep the defaults, so a comparison at another
            # prior reuses their records
            own = {k: v for k, v in shared.items() if fields["method"] == "bayesncl" or k not in GATE_SETTINGS}
            cfg = resolve(Config(**own, **fields, seed=seed, out=str(run_dir)))
            kept = args.record / run_dir.name if args.record else None
            # a record's check, its evaluation and its log read from one folder (rundir.RunFolder), as a run's copy
            with rundir.RunFolder.open(kept) if kept else contextlib.nullcontext():
                recorded = kept is not None and recorded_run(kept, cfg)
                if recorded:
                    print(f"== {name}, seed {seed}: recorded in {kept}", flush=True)
                    run_dir = kept
                    results = rundir.read_eval(run_dir, cfg.gate)
                    seconds = train_time(run_dir, cfg.batch_size)
            if not recorded:
                print(f"== {name}, seed {seed} -> {run_dir}", flush=True)
                results = Trainer(cfg).fit().evaluate()
                with rundir.RunFolder.open(run_dir):
                    if kept:
                        record(run_dir, kept)
                    seconds = train_time(run_dir, cfg.batch_size)
            runs.append(dict(name=name, family=family(fields), seed=seed, folder=run_dir.name, **results,
                             train_time_s=seconds))
            if settings is None or (cfg.method == "bayesncl" and settings.method != "bayesncl"):
                settings = cfg  # the gates' shared settings, where there are gates
    report = comparison(args.dataset, args.seeds, notes, runs, shared_settings(settings, len(args.kl_weight or ()) > 1),
                        plan, time.perf_counter() - started)
    md = write_comparison(out, report)
    if args.record:
        folder = rundir.output_folder(args.record, named=True)
        rundir.save_together([(rundir.read_bytes(out / name, rundir.TEXT_LIMIT), folder / name)
                              for name in ("comparison.md", "comparison.json")])
    print(md)
    return report


def rebuild_comparison(path: Path) -> dict:
    """--rebuild: rewrite a recorded comparison and its paired figures beside it from its runs' records.

    No run is trained; the figures of runs (consistency_vs_probe, matched_sparsity) are left to a full command, which a
    record folder need not keep.
    """
    if not path.is_file():
        raise UserError(f"--rebuild takes a comparison's json in a --record folder; {path} is no file")
    suffix = path.stem.removeprefix("comparison")  # comparison-d0.3.json -> -d0.3
    stale = mismatched(path)
    if stale:
        print(f"note: {', '.join(stale)} in {path.parent} are not the files written with {path.name} (a write of the "
              "comparison killed between its renames); --rebuild rewrites its markdown and paired figures, a full "
              "compare.py command the figures of its runs", file=sys.stderr)
    report = rebuild(path)
    print(write_comparison(path.parent, report, suffix, ("paired", "paired_mechanism")))
    return report


@one_line_errors
def main(argv=None) -> int:
    """Entry point of experiments/compare.py."""
    args = lists(parser().parse_args(argv))
    if args.rebuild:
        rebuild_comparison(args.rebuild)
    else:
        compare(args)
    return 0


LISTS = {"methods": str, "priors": str, "seeds": int, "kl_weight": float, "gate_density": float, "topk": int,
         "gate_heads": str}
"""The flags that take a list, and the type of its values."""


def lists(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with each list flag's values split at commas too (``--seeds 0,1`` is ``--seeds 0 1``), typed."""
    for name, kind in LISTS.items():
        given = getattr(args, name)
        if given is None:
            continue
        values = [v.strip() for item in given for v in item.split(",") if v.strip()]
        try:
            setattr(args, name, [kind(v) for v in values])
        except ValueError:
            bad = next(v for v in values if not _is(kind, v))
            raise UserError(f"--{name.replace('_', '-')} takes {kind.__name__} values, got {bad!r}; e.g. --seeds 0 1 "
                            "or --seeds 0,1") from None
    return args


def _is(kind, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
