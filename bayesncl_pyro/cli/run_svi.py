"""Train CL, NCL or BayesNCL with SVI, then evaluate.

    python experiments/run_svi.py                                   # BayesNCL on the generated benchmark
    python experiments/run_svi.py --dataset in100 --data-dir /data/imagenet --out runs/in100
    torchrun --nproc-per-node=4 experiments/run_svi.py --dataset in100 --data-dir ...

A run without --out goes to runs/<what it is> (runs/compositional-bayesncl-ste for the first); rerunning a command
resumes it, also on another number of processes. --config FILE (JSON or YAML, a run's config.json too) sets the
fields the flags do not.

Cost on a CPU: the default run (225 steps) takes minutes; the CIFAR-10/100 and ImageNet-100 recipes (ResNet-18, 39,000
steps for CIFAR) are GPU recipes (README.md, "Training on ImageNet-100 and other data", gives the times measured). After
its first log line every run prints how long its steps left take. Defaults marked "dataset" come from the dataset's
recipe (bayesncl_pyro/config.py, DATASET_DEFAULTS). Several machines, and a SLURM job that requeues itself: README.md
and experiments/slurm_svi.sh.

Exit status: 0 done; 1 trained and evaluated (eval.json written) but the gate export to gates.nc failed; 2 bad
input, a full or read-only --out, or a diverged run (one "error:" line); 130 stopped by Ctrl-C (SIGINT);
75 (EX_TEMPFAIL: requeue me) stopped by SIGTERM or SIGUSR1, a scheduler's pre-emption or time-limit warning.
Stopped runs saved a checkpoint first (one "stopped:" line); rerunning the command resumes them.
"""

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path

INTERRUPTED = "stopped: interrupted; rerun the same command to resume"
# the scripts users run, which call this module's main: the repository's experiments/ folder
EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

try:  # a Ctrl-C while the libraries load (seconds) is a stop like any other: one line, no traceback
    from bayesncl_pyro import distributed
    from bayesncl_pyro.cli import ArgumentParser, one_line_errors
    from bayesncl_pyro.config import (
        AUGMENT,
        CPU_RECIPE_FLAGS,
        CPU_SECONDS_PER_IMAGE,
        DATASET_DEFAULTS,
        EVAL_PROTOCOLS,
        GATE_FIELDS,
        METHODS,
        ON_NAN,
        OPTIMIZERS,
        RUNS,
        Config,
        describe_recipe,
        recipe_values,
        run_name,
        without_gates,
    )
    from bayesncl_pyro.data import DATASETS
    from bayesncl_pyro.errors import Stopped, printable
    from bayesncl_pyro.evaluate import keys
    from bayesncl_pyro.evaluate.verdict import closing_sentence
    from bayesncl_pyro.infer.estimators import GATES
    from bayesncl_pyro.models.priors import PRIORS
    from bayesncl_pyro.nn.encoders import ENCODERS
    from bayesncl_pyro.nn.losses import NONNEG
    from bayesncl_pyro.rundir import GATES_FILE, check_config_code, code_references, read_config_file
except KeyboardInterrupt:
    print(INTERRUPTED, file=sys.stderr)
    sys.exit(130)


def parser() -> argparse.ArgumentParser:
    """The command line of experiments/run_svi.py, its defaults taken from Config."""
    d = Config()
    recipes = "\n".join(f"  {name}: {describe_recipe(values)}, {values['eval_protocol']} evaluation"
                        + (" (a GPU recipe)" if name in CPU_SECONDS_PER_IMAGE else "")
                        for name, values in DATASET_DEFAULTS.items())
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"each dataset's recipe (DATASET_DEFAULTS in bayesncl_pyro/config.py), the "
                                f"defaults of the flags that say 'recipe':\n{recipes}")

    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=d.dataset, help=f"one of {', '.join(DATASETS)} (default: %(default)s: "
                   "generated shapes on backgrounds shared by every class, with known factors, no download)")
    g.add_argument("--data-dir", help="dataset folder (cifar10/100: pickled batches or {train,test}/<class>/; "
                   "imagefolder: {train,val|test}/<class>/; in100: ImageNet or ImageNet-100 train/ and val/)")
    g.add_argument("--image-size", type=int, help="training resolution in pixels " + _recipe("image_size"))
    g.add_argument("--train-subset", type=int, help="train on this many random training images (default: all)")
    g.add_argument("--holdout-cells", metavar="SHAPE:BACKGROUND,...", help="compositional: leave these (shape, "
                   "background) cells out of training and testing; their test images are the novel set "
                   "unseen-combinations of the run's novelty scores (docs/novelty.md; default: none)")
    g.add_argument("--workers", type=int, default=d.workers, help="data-loading processes (default: %(default)s)")
    g.add_argument("--augment", default=d.augment, choices=AUGMENT, help="where the two views are drawn: workers "
                   "(CPU, one image at a time), device (in whole batches on the training device, from the training "
                   "set held there when it fits, else from files the loader workers read), auto = device when "
                   "training on CUDA or when the training set is held in memory (default: %(default)s)")
    g.add_argument("--skip-bad-images", action="store_true", help="train past unreadable image files instead "
                   "of stopping; they are listed in <out>/bad_images.txt and counted at the end")

    g = p.add_argument_group("method")
    g.add_argument("--method", default=d.method, choices=METHODS, help="default: %(default)s")
    g.add_argument("--nonneg", choices=NONNEG, help="non-negativity of z; none for cl" + _recipe("nonneg"))
    g.add_argument("--topk", type=int, default=d.topk, help="keep the k largest features per row, 0 = off "
                   "(the NCL+TopK baseline)")
    g.add_argument("--temperature", type=float, default=d.temperature, help="InfoNCE tau (default: %(default)s)")

    g = p.add_argument_group("gates and prior (bayesncl)")
    g.add_argument("--prior", default=d.prior, help=f"one of {', '.join(PRIORS)}, or a Prior subclass of your own "
                   "as package.module:ClassName (default: %(default)s)")
    g.add_argument("--prior-arg", dest="prior_args", metavar="NAME=VALUE", type=_name_value, action="append",
                   default=[], help="an argument of the prior's constructor, e.g. concentration=5 for beta-bernoulli "
                   "(repeatable)")
    g.add_argument("--prior-prob", type=float, default=d.prior_prob,
                   help="prior inclusion rate rho, or its mean for hierarchical priors (default: %(default)s)")
    g.add_argument("--kl-weight", type=float, default=d.kl_weight,
                   help="lambda: weight of the per-row gate KL next to the per-row InfoNCE, fixed (default: "
                   "%(default)s)")
    g.add_argument("--gate-density", type=float, help="a target share of open gates (of the evaluation mask) in "
                   "(0, 1), for any prior: a constraint with a Lagrange multiplier of its own, raised or lowered after "
                   "every step until the share meets it; lambda stays --kl-weight, and a lambda whose KL pull is "
                   "not a small part of InfoNCE's (log.jsonl's gate_prior_pull against gate_nce_pull) holds gates "
                   "shut that the multiplier cannot open (bayesncl_pyro/infer/density.py; default: off)")
    g.add_argument("--kl-clamp", type=float, default=d.kl_clamp,
                   help="both rates of the gate KL are clamped to [c, 1 - c] as the reference does; 0 = the exact "
                   "Bernoulli KL (default: %(default)s)")
    g.add_argument("--gate", default=d.gate, choices=tuple(GATES),
                   help="how training differentiates through the gates (bayesncl_pyro/infer/estimators.py): ste (the "
                   "paper's: InfoNCE at the posterior mode, identity backward: the reference's surrogate, not the "
                   "ELBO's gradient), relaxed (a draw, the binary Concrete's gradient: biased), st-sampled (a draw, "
                   "straight-through: biased), leg (a draw, each gate's exact effect on InfoNCE: unbiased for the "
                   "ELBO), gs (the reference's Gumbel-sigmoid draw, on with probability 1 + 1e-4 - exp(1e-4 - "
                   "e^logit): biased), gs-reference-kl (gs with the reference's KL at sigmoid(logit): not an ELBO) "
                   "(default: %(default)s)")
    g.add_argument("--gate-temperature", type=float, default=d.gate_temperature,
                   help="relaxation temperature of the gates (default: %(default)s)")
    g.add_argument("--head-depth", type=int, default=d.head_depth, help="Linear layers in the gating head "
                   "(default: %(default)s)")
    g.add_argument("--gate-head", default=d.gate_head, choices=("mlp", "bayesian"),
                   help="the gating head: mlp (its weights point estimates, as the reference) or bayesian (a Normal "
                   "prior on its weights and a mean-field Normal posterior, trained in the same SVI: q(g | x) then "
                   "varies over weight draws, docs/novelty.md) (default: %(default)s)")
    g.add_argument("--logit-bound", type=float, default=d.logit_bound,
                   help="gate logits are squashed into (-b, b) so no gate saturates (default: %(default)s)")

    g = p.add_argument_group("encoder")
    g.add_argument("--encoder", help=f"backbone: one of the project's ({', '.join(ENCODERS)}), a torchvision model "
                   "(resnet50, vit_b_16, convnext_tiny, ...), timm:NAME (pip install -e '.[timm]'), or "
                   "package.module:callable returning an nn.Module of images -> features " + _recipe("encoder"))
    g.add_argument("--proj-hidden", type=int, help="projector and gating-head hidden width " + _recipe("proj_hidden"))
    g.add_argument("--proj-dim", type=int, help="K, the number of features and gates " + _recipe("proj_dim"))

    g = p.add_argument_group("optimisation")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="the optimizer" + _recipe("optimizer"))
    g.add_argument("--lr", type=float, help="base learning rate at batch 256, scaled by batch/256 " + _recipe("lr"))
    g.add_argument("--gate-lr", type=float, default=d.gate_lr, help="gating-head learning rate, not "
                   "batch-scaled (default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="default: %(default)s")
    g.add_argument("--momentum", type=float, default=d.momentum, help="default: %(default)s")
    g.add_argument("--epochs", type=int, help="passes over the training set " + _recipe("epochs"))
    g.add_argument("--warmup-epochs", type=float, help="linear warm-up, in epochs " + _recipe("warmup_epochs"))
    g.add_argument("--batch-size", type=int, help="images per step, two views each " + _recipe("batch_size"))
    g.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (smoke runs); the "
                   "schedule still spans --epochs")
    g.add_argument("--on-nan", default=d.on_nan, choices=ON_NAN, help="a step whose loss or gradients are not "
                   "finite stops the run, keeping the last good checkpoint, or is skipped (default: %(default)s)")

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-protocol", choices=EVAL_PROTOCOLS, help="linear probe and retrieval: fast (standardised "
                   "features, one lr for every backbone) or reference (the paper's, for cifar10, cifar100, in100; "
                   "docs/METHOD.md) " + _recipe("eval_protocol"))

    g = p.add_argument_group("run")
    g.add_argument("--config", metavar="FILE", help="a JSON or YAML file of Config fields (bayesncl_pyro/config.py; "
                   "a run's own config.json works as it is); the flags given here override it")
    g.add_argument("--trust-run", action="store_true", help="with a --config FILE of a run folder: import the code "
                   "that its encoder or prior names (package.module:name); such a file is refused otherwise, as it "
                   "would run its writer's code")
    g.add_argument("--out", help="run folder; rerunning into it resumes (default: runs/<what the run is>: dataset, "
                   "method, gate, and the settings that differ from the recipe, e.g. runs/compositional-bayesncl-ste)")
    g.add_argument("--overwrite", action="store_true", help="start afresh in --out, moving the run already there "
                   "(e.g. one with another config) into <out>/previous-<time>/; nothing is deleted, and a folder "
                   "that holds anything but a run is refused")
    g.add_argument("--seed", type=int, default=d.seed, help="default: %(default)s")
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda (the current GPU) or cuda:N (default: "
                   "%(default)s)")
    g.add_argument("--no-amp", dest="amp", action="store_false", help="no bf16 autocast of the encoder on CUDA")
    g.add_argument("--compile", action="store_true", help="torch.compile the encoder (worth it for long GPU runs; "
                   "the first steps wait for compilation)")
    g.add_argument("--cuda-graphs", action="store_true", help="capture the training step (forward, backward, "
                   "divergence check, optimizer step) as one CUDA graph after 3 eager steps and replay it: one launch "
                   "a step instead of hundreds, for steps the host holds up (small images); one GPU, --optimizer lars "
                   "or adamw")
    g.add_argument("--log-every", type=int, default=d.log_every, help="steps between log lines (default: %(default)s)")
    g.add_argument("--ckpt-every", type=int, default=d.ckpt_every,
                   help="steps between checkpoints (default: %(default)s)")
    g.add_argument("--ckpt-minutes", type=float, help="also save a checkpoint every this many minutes of wall-clock "
                   "time, for long epochs (default: off)")
    g.add_argument("--conflict-every", type=int, help="steps between records of the per-dimension InfoNCE "
                   "gradient conflict in conflict.jsonl, 0 = off; about one per epoch" + _recipe("conflict_every"))
    g.add_argument("--tensorboard", action="store_true", help="also write the log, the per-dimension inclusion "
                   "histogram and the evaluation as TensorBoard events in --out (pip install -e '.[tensorboard]')")
    g.add_argument("--wandb", action="store_true", help="also log them, and the config, to a Weights & Biases run "
                   "kept in <out>/wandb/ (pip install -e '.[wandb]'; WANDB_MODE=offline: no network, wandb sync later)")
    g.add_argument("--monitor-every", type=int, default=d.monitor_every, help="epochs between records of the online "
                   "kNN top-1 (backbone features, 1,024 training against 256 test images) and RankMe of the "
                   "representation in the log, 0 = off; about 4%% of the first run's time (default: %(default)s)")
    return p


def _recipe(name: str) -> str:
    """The end of a flag's help whose default is the dataset's recipe: each dataset's value."""
    return f" (default: the dataset's recipe: {recipe_values(name)})".replace("%", "%%")


def _name_value(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. concentration=5), got {text!r}")
    return name.strip(), value.strip()


def config(argv: list[str]) -> tuple[Config, bool]:
    """The Config the command line asks for, and whether it says --overwrite.

    The Config is taken before dataset defaults: the --config file's fields, if any, with the flags given on the command
    line over them.
    """
    p = parser()
    given = vars(p.parse_known_args(argv)[0])  # the flags alone, before the file's fields become their defaults
    file = given["config"]
    if file is not None:
        values = read_config_file(file)
        values["prior_args"] = list(values.get("prior_args", {}).items())  # --prior-arg appends to them
        p.set_defaults(**values)
    args = vars(p.parse_args(argv))
    overwrite, trust = args.pop("overwrite"), args.pop("trust_run")
    if file is not None:  # the code that the file names, and no flag: a run folder's is its writer's
        check_config_code(file, {k: v for k, v in values.items() if args.get(k) == v != given.get(k)}, trust)
    del args["config"]
    args["prior_args"] = dict(args["prior_args"])  # [(name, value), ...] from the repeated --prior-arg
    return Config(**args), overwrite


@one_line_errors
def main(argv=None) -> int:
    """Entry point of experiments/run_svi.py: train, evaluate, and export a gated run's gates."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, overwrite = config(argv)
        from bayesncl_pyro.train.trainer import Trainer  # after parsing: --help stays instant

        trainer = Trainer(cfg, overwrite=overwrite)
        if trainer.rank == 0:
            print(announce(trainer), flush=True)
        evaluated_before = trainer.evaluated
        results = trainer.fit().evaluate()
        if trainer.rank:
            return 0
        status = 0
        if trainer.learner.gated and not (evaluated_before and (trainer.out / GATES_FILE).exists()):
            status = export(trainer)
        print(*filter(None, [outcome(results, trainer.cfg)]), "\n" + next_steps(trainer.cfg, argv), sep="\n")
        return status
    except KeyboardInterrupt:  # outside the training loop (loading, evaluation): nothing half-written
        print(INTERRUPTED, file=sys.stderr)
        return 130
    finally:
        distributed.leave()


def _stop_at_once(signum, frame):
    """Signal handler: stop the run at once outside the training loop.

    The training loop saves, then stops; outside it a scheduler's signal stops the run at once, as Ctrl-C does: nothing
    is half-written, files are replaced by a rename. A run already on its way out (torchrun terminates the other workers
    when one exits) just goes on.
    """
    if sys.exc_info()[0] is None:
        raise Stopped(f"{signal.Signals(signum).name} received outside the training loop; rerun the same command "
                      "to resume", signum)


def announce(trainer) -> str:
    """What is trained, on what, for how long, and where it is written."""
    cfg = trainer.cfg
    args = "".join(f" {k}={v}" for k, v in cfg.prior_args.items())
    kl = "the exact KL" if cfg.kl_clamp == 0 else f"the KL's rates clamped at {cfg.kl_clamp}"
    weight = f"KL weight {cfg.kl_weight}" + ("" if cfg.gate_density is None else
                                             f", {cfg.gate_density:g} of the gates open as a constraint")
    what = {"cl": "SimCLR (CL)", "ncl": "NCL", "bayesncl": f"BayesNCL ({cfg.gate} gates, {cfg.prior} prior "
            f"rho={cfg.prior_prob}{args}, {weight}, {kl})"}[cfg.method]
    last = trainer.last_step
    steps = f"resuming at step {trainer.step} of {last}" if trainer.step else f"{last} steps"
    warning = cpu_warning(cfg, trainer.device.type, trainer.last_step - trainer.step)
    return (f"training {what} on {cfg.dataset} ({len(trainer.data.train)} training images at {cfg.image_size} px, "
            f"{cfg.encoder}, K={cfg.proj_dim} features, batch {cfg.batch_size}, {cfg.optimizer} lr {cfg.lr:g}; "
            f"{steps}) on {trainer.device}; writing to {trainer.out}/\nthe loss it minimises: "
            f"{trainer.learner.head.objective}"
            + "".join(f"\nthe KL of latent site {site!r}: {kind}"  # how the ELBO takes it (infer/kl.py)
                      for site, kind in trainer.learner.head.kl_kind.items())
            + (f"\n{warning}" if warning else ""))


def cpu_warning(cfg: Config, device: str, steps: int) -> str:
    """A warning where a GPU recipe is about to train on a CPU, with its cost and a CPU recipe's flags; else "".

    Args:
        cfg: the run's Config, its recipe filled in.
        device: the training device's type ("cpu", "cuda").
        steps: the training steps left.
    """
    recipe = DATASET_DEFAULTS[cfg.dataset]
    if device != "cpu" or cfg.dataset not in CPU_SECONDS_PER_IMAGE or (cfg.encoder, cfg.image_size) != (
            recipe["encoder"], recipe["image_size"]):  # the cost was measured for the recipe's backbone and size
        return ""
    seconds = steps * cfg.batch_size * CPU_SECONDS_PER_IMAGE[cfg.dataset]
    cost = (f"{seconds / 86400:.0f} days" if seconds >= 2 * 86400 else f"{seconds / 3600:.1f} hours"
            if seconds >= 3600 else f"{max(seconds / 60, 1):.0f} min")
    return (f"warning: {cfg.dataset}'s recipe is a GPU recipe ({describe_recipe(cfg.to_dict())}) and this run trains "
            f"on the CPU: about {CPU_SECONDS_PER_IMAGE[cfg.dataset]} s an image on 2 CPU cores, so its {steps:,} steps "
            f"of {cfg.batch_size} images take about {cost}; a CPU recipe: {CPU_RECIPE_FLAGS} (README.md, \"Training "
            "on ImageNet-100 and other data\")")


def export(trainer) -> int:
    """Write gates.nc; a failure (a missing package, a full disk) is one line, and eval.json stays."""
    try:
        from bayesncl_pyro.evaluate.arviz_export import export_gates  # late: arviz is slow to import

        export_gates(trainer.out, trainer.learner, trainer.data, test=trainer.test_features)
    except Stopped:  # a signal (run_svi's handler), not a failed export
        raise
    except Exception as e:  # training and evaluation are done and saved: explain, never lose them
        cause = str(e).splitlines()[0] if str(e) else ""
        print(f"error: the gate export failed ({e.__class__.__name__}: {cause}); eval.json and the checkpoint are "
              f"kept in {trainer.out}; redo the export with: "
              f"{command(trainer.cfg, 'inspect_gates.py', str(trainer.out), '--export')}", file=sys.stderr)
        return 1
    return 0


def outcome(results: dict, cfg: Config) -> str:
    """What the gates did, in words, from an eval dict.

    Empty for CL and NCL. The paper's consistency and the top-N one beside post-hoc TopK of the same features, then, on
    generated data, which factor the dims follow, and last this run's comparison beside the ten-seed result
    (``verdict.closing_sentence``; ``cfg``, the run's, says whether that result is of this run's recipe).
    """
    if "gates_open" not in results:
        return ""
    opened = {metric: v for (metric, r), v in zip(map(keys.parse, results), results.values()) if r == keys.UNGATED}
    gated, ungated = results["semantic_consistency"], opened["semantic_consistency"]
    posthoc = results.get("controls", {}).get("posthoc_topk")
    lines = [f"the gates keep {results['gates_open']:.0%} of the (image, feature) pairs open; the paper's semantic "
             f"consistency {gated:.3f} with the gates, {ungated:.3f} with every gate open "
             f"({gated / max(ungated, 1e-12):.2f}x)" + (
                 f", {posthoc['semantic_consistency']:.3f} for post-hoc TopK (the same features, each image keeping "
                 "its largest entries, as many as its gates kept)" if posthoc else "")
             + f"; active dims {results['active_dims']} of {opened['active_dims']}"]
    if posthoc and "semantic_consistency_topn" in posthoc:
        n, topn, chance = results["topn_n"], results["semantic_consistency_topn"], results["topn_chance"]
        lines.append(f"top-{n} consistency (each dim judged on its {n} strongest test images: {chance:.3f} for a "
                     f"class-blind dim, however sparse): {topn:.3f} with the gates ({results['topn_coverage_dims']} "
                     f"dims judged), {opened['semantic_consistency_topn']:.3f} with every gate open, "
                     f"{posthoc['semantic_consistency_topn']:.3f} for post-hoc TopK")
    factors = [m.removeprefix("dims_tracking_") for m in opened if m.startswith("dims_tracking_")]
    if factors:  # generated data that records its factors: which of them the dims follow, before and after gating
        def tracking(figures: dict) -> str:
            counts = [figures[f"dims_tracking_{f}"] for f in factors]
            names = [printable(f) for f in factors]  # an eval.json from elsewhere: no escape reaches the terminal
            return f"{counts[0]} dim{'s track' if counts[0] != 1 else ' tracks'} the {names[0]}" + "".join(
                f" and {n} the {f}" for n, f in zip(counts[1:], names[1:]))
        off = " and ".join(str(results[f"gated_off_dims_{f}"]) for f in factors)
        lines += [f"with every gate open, {tracking(opened)}; the gates switch off {off} of them (closed in most "
                  "images where they fire)", f"with the gates, {tracking(results)}"]
    if posthoc and "semantic_consistency_topn" in posthoc:
        lines.append(closing_sentence(results, cfg))
    return "\n".join(lines)


def next_steps(cfg: Config, argv: list[str]) -> str:
    """The commands that look at the gates and train the NCL baseline on the same budget.

    Every path in them absolute, so that they run as printed from any folder. The NCL command leaves out the gates'
    flags (:data:`config.GATE_FIELDS`): NCL builds no prior, and a baseline that recorded a prior of the user's own
    would need its code (and --trust-run) to be opened.
    """
    named = cfg.out == str(Path(RUNS) / run_name(cfg))  # no --out: the baseline is named by what it is, too
    ncl = without_gates(cfg, "ncl")
    base = os.path.abspath(Path(RUNS) / run_name(ncl) if named else cfg.out + "-ncl")
    out = os.path.abspath(cfg.out)
    baseline = ["--baseline", base] if cfg.method == "bayesncl" else []
    steps = [command(cfg, "inspect_gates.py", out, *baseline),
             f"    the gate posterior, class x feature inclusion, the optimisation conflict (figures in "
             f"{shlex.quote(out)}/inspect/)",
             command(cfg, "report.py", out, *baseline),
             f"    a card per dimension, one page: {shlex.quote(out)}/report/index.html"]
    if cfg.method == "bayesncl":
        gate_flags = ["--prior-arg" if f == "prior_args" else "--" + f.replace("_", "-") for f in GATE_FIELDS]
        flags = _absolute(_without(argv, "--method", "--out", "--overwrite", *gate_flags), *PATH_FLAGS)
        steps[:0] = [command(ncl, "run_svi.py", *flags, "--method", "ncl", "--out", base),
                     "    NCL on the same data and budget: the baseline the gates are judged against"]
    return "next:\n" + "\n".join("  " + line for line in steps)


PATH_FLAGS = ("--data-dir", "--config")
"""run_svi.py's flags whose value is a path (but --out, which the printed commands set)."""


def command(cfg: Config, script: str, *args: str) -> str:
    """The command line that runs ``experiments/<script> args`` as this run was started.

    By this run's interpreter and, for code of the user's own (``package.module:name``), with its PYTHONPATH (and
    --trust-run: the run is the user's own); paths absolute, so that it runs from any folder.
    """
    env = os.environ.get("PYTHONPATH") if code_references(cfg) else None
    if env:  # its folders as seen from here, so that they are the same from anywhere
        env = os.pathsep.join(os.path.abspath(p) if p else p for p in env.split(os.pathsep))
    trust = ["--trust-run"] if code_references(cfg) and script != "run_svi.py" else []
    words = [os.path.abspath(sys.executable), str(EXPERIMENTS / script), *args, *trust]
    return (f"PYTHONPATH={shlex.quote(env)} " if env else "") + " ".join(shlex.quote(w) for w in words)


def _absolute(argv: list[str], *flags: str) -> list[str]:
    """Argv with the values of the given flags made absolute paths (``--flag value`` or ``--flag=value``)."""
    out, path_next = [], False
    for a in argv:
        name, eq, value = a.partition("=")
        if path_next:
            out.append(os.path.abspath(a))
        elif eq and name in flags:
            out.append(f"{name}={os.path.abspath(value)}")
        else:
            out.append(a)
        path_next = not path_next and not eq and a in flags
    return out


def _without(argv: list[str], *flags: str) -> list[str]:
    """Argv without the given flags and their values (``--flag value`` or ``--flag=value``)."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.split("=")[0] in flags:
            skip = "=" not in a and a != "--overwrite"
        else:
            kept.append(a)
    return kept


if __name__ == "__main__":
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, _stop_at_once)
    sys.exit(main())
