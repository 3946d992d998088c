"""CL, NCL, NCL+TopK and BayesNCL side by side: one recipe, the same seeds, one table.

    python experiments/compare.py --dataset cifar10 --data-dir /data/cifar10       # CPU recipe, ~3 runs
    python experiments/compare.py --dataset compositional --methods all              # generated, no files
    python experiments/compare.py --dataset cifar10 --data-dir /data/cifar10 --recipe reference \\
        --methods all --seeds 0 1 2                                                  # the paper's recipe (GPU)

Each method and seed trains into <out>/<method>-seed<k>/ with experiments/run_svi.py's Trainer and is
evaluated the same way (eval.json), plus retrieval P@k. Rerunning the command reuses finished runs and
resumes interrupted ones; a folder holding a run with other settings is an error, never mixed in.
Writes <out>/comparison.md, comparison.json and consistency_vs_probe.png.

--recipe cpu (the default) keeps the dataset's recipe where it is already a CPU one (digits,
compositional) and otherwise replaces ResNet-18 + LARS by METHOD.md section 5's CPU recipe: a 4-block
CNN, at most 10,000 training images, 15 epochs, SGD lr 0.06 with cosine, batch 256.
"""

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from bayesncl_pyro.config import DATASET_DEFAULTS, Config
from bayesncl_pyro.data import DATASETS
from bayesncl_pyro.errors import UserError

GATED = ("relaxed", "ste", "gs")
METHOD_NAMES = ("cl", "ncl", "ncl+topk", *(f"bayesncl-{g}" for g in GATED))
DEFAULT_METHODS = "cl,ncl,bayesncl-ste"
CPU_RECIPE = dict(encoder="cnn", epochs=15, optimizer="sgd", lr=0.06, warmup_epochs=1, batch_size=256)
CPU_SUBSET = 10_000

# (column, eval key, scale, format): fractions are shown in percent as in the paper's tables
COLUMNS = [("Cons.", "semantic_consistency", 100, ".2f"), ("H_s", "semantic_entropy", 1, ".3f"),
           ("Act.", "activation_rate", 100, ".2f"), ("LP@1", "linear_probe_top1", 100, ".2f"),
           ("LP@5", "linear_probe_top5", 100, ".2f"), ("kNN", "knn_top1", 100, ".2f"),
           ("P@1", "retrieval_p@1", 100, ".2f"), ("P@3", "retrieval_p@3", 100, ".2f"),
           ("P@5", "retrieval_p@5", 100, ".2f"), ("P@10", "retrieval_p@10", 100, ".2f"),
           ("Sparsity", "sparsity", 100, ".2f"), ("Eff. rank", "effective_rank", 1, ".3f"),
           ("Dims", "active_dims", 1, ".0f"), ("Gates on", "gate_rate", 100, ".1f"),
           ("Train s", "train_time_s", 1, ".0f")]
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
    g = p.add_argument_group("shared settings (override the recipe; default: recipe)")
    for flag, kind in (("encoder", str), ("train-subset", int), ("epochs", int), ("batch-size", int),
                       ("optimizer", str), ("lr", float), ("warmup-epochs", float), ("proj-hidden", int),
                       ("proj-dim", int), ("image-size", int), ("max-steps", int), ("prior-prob", float),
                       ("kl-weight", float)):
        g.add_argument(f"--{flag}", type=kind)
    g.add_argument("--topk", type=int, help="k of NCL+TopK (default: proj-dim / 8)")
    g.add_argument("--workers", type=int, default=2)
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    return p


def method_configs(methods: list[str], priors: list[str], topk: int) -> dict[str, dict]:
    """Run name -> the Config fields that make that method; BayesNCL once per prior."""
    made = {}
    for m in methods:
        if m.startswith("bayesncl-"):
            for prior in priors:
                name = m if prior == "bernoulli" else f"{m}+{prior}"
                made[name] = dict(method="bayesncl", gate=m.removeprefix("bayesncl-"), prior=prior)
        else:
            made[m] = dict(method="cl") if m == "cl" else dict(method="ncl", topk=topk if m == "ncl+topk" else 0)
    return made


def shared_config(args, train_size: int) -> tuple[dict, list[str]]:
    """The Config fields every method shares, and notes on what departs from the reference recipe."""
    fields = {f.name for f in dataclasses.fields(Config)}
    shared = {k: v for k, v in vars(args).items() if k in fields and v is not None and k not in ("out", "topk")}
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


def train_time(run_dir: Path, batch_size: int) -> float:
    """Seconds spent in training steps, summed from log.jsonl (each line's images / images_per_s); steps
    replayed after a resume are counted once."""
    from bayesncl_pyro.training import read_log

    by_step = {rec["step"]: rec["images_per_s"] for rec in read_log(run_dir)}
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
    from bayesncl_pyro.training import Trainer

    methods = METHOD_NAMES if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in METHOD_NAMES]
    if unknown:
        raise UserError(f"unknown --methods {', '.join(unknown)}; choose from {', '.join(METHOD_NAMES)} or 'all'")
    out = Path(args.out or f"runs/compare-{args.dataset}")
    train_size = len(load_dataset(args.dataset, args.data_dir).train)
    shared, notes = shared_config(args, train_size)
    proj_dim = shared.get("proj_dim") or DATASET_DEFAULTS[args.dataset]["proj_dim"]
    runs = []
    for name, fields in method_configs(methods, args.priors.split(","), args.topk or max(1, proj_dim // 8)).items():
        for seed in args.seeds:
            run_dir = out / f"{name}-seed{seed}"
            print(f"== {name}, seed {seed} -> {run_dir}", flush=True)
            trainer = Trainer(Config(**shared, **fields, seed=seed, out=str(run_dir)))
            results = trainer.fit()
            runs.append(dict(name=name, seed=seed, folder=run_dir.name, **results,
                             train_time_s=train_time(run_dir, trainer.cfg.batch_size)))
    keys = [c[1] for c in COLUMNS + FACTOR_COLUMNS]
    summary = summarise(runs, keys)
    settings = {k: v for k, v in trainer.cfg.identity().items() if k not in ("method", "gate", "prior", "topk", "seed")}
    report = dict(dataset=args.dataset, seeds=args.seeds, notes=notes, settings=settings, summary=summary, runs=runs)
    (out / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, out / "consistency_vs_probe.png")
    md = [f"# {args.dataset}: " + " vs ".join(summary), "",
          *(f"- {n}" for n in notes),
          f"- seeds {args.seeds}" + (" (mean ± std)" if len(args.seeds) > 1 else "") + "; metrics on the test split, "
          "in percent except H_s (nats), effective rank (nats), Dims and train seconds", "",
          table(summary, COLUMNS, len(args.seeds))]
    if any(FACTOR_COLUMNS[0][1] in r for r in runs):
        md += ["", "Dimensions by the ground-truth factor they track (bg = background). (F): in the evaluated "
               "representation; ungated: BayesNCL's features before its gates; gated off: share of the dims that "
               "the gates close in most samples where they fire.", "", table(summary, FACTOR_COLUMNS, len(args.seeds))]
    md += ["", "Shared settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()), ""]
    (out / "comparison.md").write_text("\n".join(md))
    print("\n".join(md))
    return report


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        compare(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
