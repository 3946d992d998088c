"""The one configuration of a run: saved inside every checkpoint and as ``config.json`` in the run folder.

Fields left ``None`` take their dataset's default (``DATASET_DEFAULTS``), filled in by :func:`resolve`,
so the saved config always holds the values that were actually used.
"""

import collections
import dataclasses
import difflib
import hashlib
import json
import re
import types
from dataclasses import dataclass, field
from pathlib import Path

from bayesncl_pyro.errors import QUOTE_LIMIT, UserError, quoted

METHODS = ("cl", "ncl", "bayesncl")
OPTIMIZERS = ("lars", "sgd", "adamw")
ON_NAN = ("stop", "skip")
AUGMENT = ("auto", "workers", "device")
EVAL_PROTOCOLS = ("fast", "reference")  # bayesncl_pyro.evaluate.heldout.protocol

# The reference recipes (docs/METHOD.md, "Settings of the reference") for CIFAR and ImageNet-100, evaluated
# by the reference's protocol; digits is our CPU demo.
DATASET_DEFAULTS = {
    "digits": dict(image_size=8, encoder="cnn", proj_hidden=512, proj_dim=64, nonneg="rep_relu", epochs=50,
                   batch_size=256, optimizer="sgd", lr=0.1, warmup_epochs=2, conflict_every=5, eval_protocol="fast"),
    # the generated benchmark: the small-budget recipe (docs/METHOD.md, "At a small budget")
    "compositional": dict(image_size=32, encoder="cnn", proj_hidden=512, proj_dim=64, nonneg="rep_relu", epochs=15,
                          batch_size=256, optimizer="sgd", lr=0.06, warmup_epochs=1, conflict_every=15,
                          eval_protocol="fast"),
    "cifar10": dict(image_size=32, encoder="resnet18", proj_hidden=2048, proj_dim=256, nonneg="rep_relu", epochs=200,
                    batch_size=256, optimizer="lars", lr=0.4, warmup_epochs=10, conflict_every=200,
                    eval_protocol="reference"),
    "in100": dict(image_size=224, encoder="resnet18", proj_hidden=16384, proj_dim=2048, nonneg="relu", epochs=100,
                  batch_size=128, optimizer="lars", lr=0.3, warmup_epochs=10, conflict_every=1000,
                  eval_protocol="reference"),
}
DATASET_DEFAULTS["cifar100"] = dict(DATASET_DEFAULTS["cifar10"])  # a copy: changing one recipe leaves the other
# any image folder: ImageNet-100's recipe with CIFAR's projector; the paper publishes no numbers to compare with
DATASET_DEFAULTS["imagefolder"] = dict(DATASET_DEFAULTS["in100"], proj_hidden=2048, proj_dim=256, eval_protocol="fast")

# What a step of a GPU recipe costs on a CPU, measured on 2 idle CPU cores in float32: seconds per training image (its
# two views, forward and backward). ResNet-18 with CIFAR's stem at 32 px: 2.4-2.6 s for 32 images (README.md, "Training
# on ImageNet-100 and other data"); with ImageNet's stem at 224 px: 2.5 images/s. Other recipes are CPU ones.
CPU_SECONDS_PER_IMAGE = {"cifar10": 0.075, "cifar100": 0.075, "in100": 0.4, "imagefolder": 0.4}
# A recipe for a CPU on such data: the small CNN at 32 px, as the README's CIFAR-on-a-CPU example
CPU_RECIPE_FLAGS = "--encoder cnn --image-size 32 --optimizer sgd --lr 0.1 --eval-protocol fast"


def describe_recipe(values: dict) -> str:
    """A recipe's settings in words, e.g. ``32 px, cnn, K=64, batch 256, sgd lr 0.06, 15 epochs``.

    Args:
        values: a dataset's ``DATASET_DEFAULTS`` entry, or a resolved Config's fields (``Config.to_dict``).
    """
    return (f"{values['image_size']} px, {values['encoder']}, K={values['proj_dim']}, batch {values['batch_size']}, "
            f"{values['optimizer']} lr {values['lr']:g}, {values['epochs']} epochs")


def recipe_values(name: str) -> str:
    """Each dataset's recipe value of one field, for ``--help``: ``compositional 32, digits 8, ...``."""
    return ", ".join(f"{dataset} {values[name]}" for dataset, values in DATASET_DEFAULTS.items())


RUNS = "runs"
"""Where a run given no ``--out`` goes: ``runs/<run_name>``, below the current folder."""


RECORDED = ("num_threads",)
"""What a run's ``config.json`` records besides the settings: facts of the machine that ran it (torch's thread count,
on which a CPU run's float sums depend), read past by :meth:`Config.from_dict`."""


@dataclass
class Config:
    """A run's settings: every field a flag or a config file may set, with its default.

    Each field is the flag of ``experiments/run_svi.py`` of the same name (``data_dir``: ``--data-dir``); a field left
    ``None`` takes the dataset's recipe (``DATASET_DEFAULTS``) when the trainer resolves the config.

    Examples:
        >>> cfg = Config(dataset="digits", max_steps=20, out="runs/quick")  # train it: Trainer(cfg).fit()
        >>> cfg.method, cfg.gate, cfg.prior_prob, cfg.epochs  # epochs None: the recipe's, when the trainer resolves it
        ('bayesncl', 'ste', 0.8, None)
        >>> Config.from_dict(cfg.to_dict()) == cfg
        True

    Args:
        dataset: the images: ``compositional`` (generated, known factors), ``digits``, ``cifar10``, ``cifar100``,
            ``imagefolder``, ``in100``.
        data_dir: the dataset's folder (not needed for the generated ones).
        image_size: training resolution in pixels (None: the recipe's).
        train_subset: train on this many random training images (None: all).
        workers: data-loading processes.
        augment: where the two views are drawn: ``workers`` (CPU, one image at a time), ``device`` (batched on the
            training device) or ``auto``.
        skip_bad_images: train past unreadable image files instead of stopping (listed in ``bad_images.txt``).
        holdout_cells: compositional only: ``shape:background`` cells left out of training and testing, the novel set
            of the novelty scores.
        method: ``bayesncl``, ``ncl`` or ``cl`` (SimCLR).
        nonneg: the non-negativity of z: ``relu``, ``rep_relu`` or ``none`` (None: the recipe's; none for ``cl``).
        topk: keep the k largest features per row, 0 = off (the NCL+TopK baseline).
        temperature: InfoNCE's tau.
        prior: the gate prior: a name of ``PRIORS`` or ``package.module:ClassName``.
        prior_prob: the prior inclusion rate rho (its mean for a hierarchical prior).
        prior_args: the prior's other constructor arguments, by name (``--prior-arg NAME=VALUE``).
        kl_weight: lambda, the weight of the per-row gate KL beside the per-row InfoNCE (with ``gate_density``: its
            starting value).
        gate_density: a target share of open gates in (0, 1): lambda then follows it as a Lagrange multiplier
            (None: lambda fixed).
        kl_clamp: both rates of the gate KL clamped to [c, 1 - c], as the reference does; 0 = the exact KL.
        gate: the gate estimator, how training differentiates through the gates (a name of ``GATES``: ``ste``,
            ``relaxed``, ``st-sampled``, ``leg``, ``gs``, ``gs-reference-kl``).
        gate_temperature: the relaxation temperature of the relaxed estimators.
        head_depth: Linear layers in the gating head.
        gate_head: ``mlp`` (point-estimate weights) or ``bayesian`` (a Normal posterior over the head's weights).
        logit_bound: gate logits squashed into (-b, b), so that no gate saturates.
        encoder: the backbone: a name of ``ENCODERS``, a torchvision model, ``timm:NAME`` or
            ``package.module:callable`` (None: the recipe's).
        proj_hidden: the projector's and gating head's hidden width (None: the recipe's).
        proj_dim: K, the number of features and gates (None: the recipe's).
        optimizer: ``lars``, ``adamw`` or ``sgd`` (None: the recipe's).
        lr: the base learning rate at batch 256, scaled by batch / 256 (None: the recipe's).
        gate_lr: the gating head's learning rate, not batch-scaled.
        weight_decay: the optimizer's weight decay.
        momentum: the optimizer's momentum.
        epochs: passes over the training set (None: the recipe's).
        warmup_epochs: the linear warm-up, in epochs (None: the recipe's).
        batch_size: images per step, two views each (None: the recipe's).
        max_steps: stop after this many optimizer steps (a short run); the schedule still spans ``epochs``.
        out: the run folder; rerunning into it resumes (None: ``runs/<what the run is>``).
        seed: the seed of data order, augmentation and initialisation.
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        amp: bf16 autocast of the encoder on CUDA.
        compile: ``torch.compile`` the encoder.
        cuda_graphs: capture the training step as one CUDA graph and replay it.
        log_every: steps between log records.
        ckpt_every: steps between checkpoints.
        ckpt_minutes: also checkpoint every this many minutes of wall-clock time (None: off).
        on_nan: a step whose loss or gradients are not finite: ``stop`` the run (keeping the last good checkpoint)
            or ``skip`` it.
        conflict_every: steps between records of the per-dimension gradient conflict in ``conflict.jsonl``, 0 = off
            (None: about one per epoch).
        eval_protocol: the linear probe and retrieval: ``fast`` or ``reference`` (the paper's; None: the recipe's).
        tensorboard: also write the log and the evaluation as TensorBoard events in the run folder.
        wandb: also log them, and the config, to a Weights & Biases run.
        monitor_every: epochs between the online kNN top-1 and RankMe records in the log, 0 = off.
    """

    # data
    dataset: str = "compositional"  # generated, with known factors: the first run shows what the gates do
    data_dir: str | None = None
    image_size: int | None = None
    train_subset: int | None = None  # train on this many random training images (small-budget runs)
    workers: int = 2
    augment: str = "auto"  # where views are drawn: "workers" (CPU, per image), "device" (batched), auto: see Trainer
    skip_bad_images: bool = False
    holdout_cells: str | None = None  # compositional: shape:background cells never trained on (a novel set)
    # method
    method: str = "bayesncl"
    nonneg: str | None = None
    topk: int = 0
    temperature: float = 0.2
    # gates (BayesNCL)
    prior: str = "bernoulli"  # a registry name (models/priors.py) or package.module:ClassName
    prior_prob: float = 0.8
    prior_args: dict = field(default_factory=dict)  # the prior's other constructor arguments, by name
    kl_weight: float = 3e-5  # lambda, the KL's weight (fixed, with or without gate_density)
    gate_density: float | None = None  # a constraint on the share of open gates, its own multiplier (density.py)
    kl_clamp: float = 0.01  # the KL's rates clamped to [c, 1 - c] as the reference; 0 = the exact KL
    gate: str = "ste"  # the paper's main estimator, "BayesNCL (STE)"; the names: estimators.py, GATES
    gate_temperature: float = 1.0
    head_depth: int = 2
    gate_head: str = "mlp"  # "bayesian": a posterior over the gating head's weights (guides/gates.py)
    logit_bound: float = 5.0
    # encoder
    encoder: str | None = None  # a name in encoders.ENCODERS, a torchvision model, timm:NAME or package.module:callable
    proj_hidden: int | None = None
    proj_dim: int | None = None
    # optimisation
    optimizer: str | None = None
    lr: float | None = None
    gate_lr: float = 0.1
    weight_decay: float = 1e-4
    momentum: float = 0.9
    epochs: int | None = None
    warmup_epochs: float | None = None
    batch_size: int | None = None
    max_steps: int | None = None
    # run
    out: str | None = None  # the run folder; None: runs/<what the run is> (run_name)
    seed: int = 0
    device: str = "auto"
    amp: bool = True
    compile: bool = False
    cuda_graphs: bool = False  # the training step captured once as a CUDA graph and replayed (train/graph.py)
    log_every: int = 10
    ckpt_every: int = 500
    ckpt_minutes: float | None = None  # also checkpoint every this many minutes (rank 0's clock); None = off
    on_nan: str = "stop"
    conflict_every: int | None = None  # steps between conflict.jsonl records (about one per epoch), 0 = off
    # evaluation
    eval_protocol: str | None = None  # linear probe and retrieval: "fast" (small runs) or "reference" (the paper's)
    tensorboard: bool = False  # also write the log and the evaluation as TensorBoard events in the run folder
    wandb: bool = False  # also log them, and the config, to a Weights & Biases run (loggers.py)
    monitor_every: int = 5  # epochs between online kNN top-1 and RankMe records in the log (monitor.py), 0 = off

    def to_dict(self) -> dict:
        """The fields as a plain dict, as ``config.json`` holds them.

        Returns:
            Field name -> value, for every field.
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """The Config of a ``to_dict`` dict; one written by version 0.1 gets the settings it computed with.

        Args:
            d: field name -> value (a run's ``config.json``); a field it lacks takes its default.

        Returns:
            The Config.

        Raises:
            UserError: ``d`` holds a key that is no field (a file of another version).
        """
        if "kl_clamp" not in d:  # written by bayesncl-pyro 0.1: the settings that reproduce what it computed
            d = dict(d, eval_protocol="fast", gate={"gs": "gs-reference-kl"}.get(d.get("gate"), d.get("gate")))
        d = {k: v for k, v in d.items() if k not in RECORDED}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:  # a few of them, each quoted short: a file may hold 300,000 (a 48.6 MB line)
            shown = ", ".join(quoted(k) for k in sorted(unknown, key=str)[:4])
            more = f" and {len(unknown) - 4:,} more" if len(unknown) > 4 else ""
            raise UserError(f"config has unknown keys [{shown}{more}]: it was written by another version "
                            "of bayesncl-pyro; start a new --out folder")
        return cls(**d)

    def identity(self) -> dict:
        """The fields that change the numbers of a run, as a dict.

        The rest (out, device, workers, augment, logging, and the answers to faults met on the way: bad images,
        non-finite steps) may differ on resume.

        Returns:
            Field name -> value, for the fields that a resumed run must share with the one it resumes.
        """
        d = self.to_dict()
        for k in ("out", "device", "workers", "augment", "log_every", "ckpt_every", "ckpt_minutes", "conflict_every",
                  "data_dir", "max_steps", "compile", "cuda_graphs", "skip_bad_images", "on_nan", "tensorboard",
                  "wandb", "monitor_every"):
            d.pop(k)
        return d

    def differences(self, other: "Config") -> str:
        """The identity fields that differ.

        Args:
            other: the config to compare with.

        Returns:
            ``"name: self -> other, ..."``, or ``""`` when none differ.
        """
        a, b = self.identity(), other.identity()
        return ", ".join(f"{k}: {quoted(a[k])} -> {quoted(b[k])}" for k in a if a[k] != b[k])


def parse_file(path: Path, data: bytes) -> dict:
    """Read the Config fields that a JSON or YAML config file sets, checked.

    The file is ``run_svi.py --config``'s, ``data`` its bytes (read by ``rundir.read_config_file``). A key that is no
    field is refused naming the closest one, and a value of the wrong type naming the field. A run's own ``config.json``
    reads as it is, but for its ``out``: the folder it sits in is where that run is, not where another one goes.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--config {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            values = _UniqueKeyLoader(text).get_single_data()
        else:
            values = json.loads(text, object_pairs_hook=_unique_keys)
    except Exception as e:  # json's and yaml's errors (a RecursionError too): the file is not what its name says
        cause = "nested too deep" if isinstance(e, RecursionError) else str(e).splitlines()[0] if str(e) else \
            type(e).__name__
        kind = "YAML" if path.suffix.lower() in (".yaml", ".yml") else "JSON"
        raise UserError(f"--config {path} is not readable {kind} ({cause}); a file of Config fields, e.g. "
                        '{"dataset": "cifar10", "epochs": 100}')
    if not isinstance(values, dict):
        raise UserError(f"--config {path} holds a {type(values).__name__}, not a mapping of Config fields to values")
    check_extent(values, f"--config {path}", "a YAML alias nested in aliases repeats its values",
                 "a file of Config fields holds a few dozen")
    values = {k: v for k, v in values.items() if k not in RECORDED}  # a run's config.json, as it is
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key)[:QUOTE_LIMIT], fields, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "the fields are those of bayesncl_pyro.config.Config"
            raise UserError(f"--config {path}: unknown key {quoted(key)}; {hint}")
        _check_type(path, key, value, fields[key])
    if values.get("out") is not None and Path(values["out"]).resolve() == path.parent.resolve():
        del values["out"]
    return values


MAX_VALUES, MAX_TEXT = 1_000_000, 4096  # what a config file's values may hold: no setting is longer than a path


def check_extent(values: dict, what: str, repeats: str, fix: str):
    """Refuse config values that are too many or too long to handle safely, naming them ``what``.

    Refused before anything walks, copies or prints them whole: values that hold more than ``MAX_VALUES`` items,
    counted with repeats (``repeats`` says how a small file holds so many; ``fix`` ends the message), or a string of
    more than ``MAX_TEXT`` characters. A YAML alias bomb (a few hundred bytes that name 9^9 strings, under a key or in
    prior_args) or a pickled list of shared references (a checkpoint's) would fill the memory.
    """
    stack, count = [values], 0
    while stack:
        value = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise UserError(f"{what} holds more than {MAX_VALUES:,} values ({repeats}); {fix}")
        if isinstance(value, str) and len(value) > MAX_TEXT:
            raise UserError(f"{what} holds a string of {len(value):,} characters ({quoted(value)}), more "
                            f"than the {MAX_TEXT} of the longest path; no setting takes one")
        if isinstance(value, dict):
            stack += [*value, *value.values()]
        elif isinstance(value, list):
            stack += value


def _unique_keys(pairs: list) -> dict:
    """A mapping of a config file, refusing a key given twice (the second would silently win)."""
    mapping = dict(pairs)
    if len(mapping) < len(pairs):  # (a count per key would take a time quadratic in the number of keys)
        twice = sorted(str(k)[:QUOTE_LIMIT] for k, n in collections.Counter(k for k, _ in pairs).items() if n > 1)
        more = f" and {len(twice) - 4} more" if len(twice) > 4 else ""
        raise ValueError(f"{', '.join(twice[:4])}{more} given twice: keep one")
    return mapping


def _UniqueKeyLoader(text: str):
    """YAML's safe loader refusing a key given twice in one mapping."""
    import yaml  # late: only a YAML file needs it

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            # the keys written in this mapping; a merged one (<<: *anchor) may be overridden, as YAML means
            _unique_keys([(self.construct_object(k, deep=deep), None) for k, _ in node.value
                          if k.tag != "tag:yaml.org,2002:merge"])
            return super().construct_mapping(node, deep=deep)

    return Loader(text)


def _check_type(path: Path, key: str, value, annotation):
    allowed = annotation.__args__ if isinstance(annotation, types.UnionType) else (annotation,)
    for t in allowed:
        if value is None if t is type(None) else isinstance(value, t) and (type(value) is not bool or t is bool) or (
                t is float and type(value) is int):
            return
    names = " or ".join("null" if t is type(None) else {"int": "an integer", "float": "a number", "str": "a string",
                                                       "bool": "true or false", "dict": "a mapping"}[t.__name__]
                        for t in allowed)
    raise UserError(f"--config {path}: {key} must be {names}, got {quoted(value)}")


def run_name(cfg: Config) -> str:
    """The folder name of a run given no ``--out``.

    First what it is, ``<dataset>-<method>[-<gate>]``, then the settings of its identity that differ from its dataset's
    recipe as ``name=value`` (a hash of them when they are many), e.g. ``compositional-bayesncl-ste``,
    ``compositional-ncl-topk=16``, ``cifar10-bayesncl-ste-encoder=cnn,seed=1``. ``cfg``: with its recipe's defaults
    filled in.
    """
    mine, recipe = cfg.identity(), with_recipe(Config(dataset=cfg.dataset, method=cfg.method)).identity()
    named = ["dataset", "method"] + (["gate"] if cfg.method == "bayesncl" else [])
    changed = {**{k: mine[k] for k in mine if k not in named and mine[k] != recipe[k]}, **mine["prior_args"]}
    changed.pop("prior_args", None)  # its arguments stand for it, by their names
    # a name that every file system and shell takes as it is
    tag = ",".join(f"{k}={re.sub(r'[^A-Za-z0-9._+-]', '.', str(v))}" for k, v in changed.items())
    if len(tag) > 48:
        tag = hashlib.sha1(tag.encode()).hexdigest()[:8]
    return "-".join([mine[k] for k in named] + ([tag] if tag else []))


def with_recipe(cfg: Config) -> Config:
    """``cfg`` with the fields it leaves None set by its dataset's recipe (``DATASET_DEFAULTS``)."""
    defaults = {k: v for k, v in DATASET_DEFAULTS[cfg.dataset].items() if getattr(cfg, k) is None}
    if cfg.method == "cl" and cfg.nonneg is None:
        defaults["nonneg"] = "none"
    return dataclasses.replace(cfg, **defaults)


GATE_FIELDS = ("prior", "prior_prob", "prior_args", "kl_weight", "gate_density", "kl_clamp", "gate", "gate_temperature",
               "gate_head", "head_depth", "logit_bound", "gate_lr")
"""The fields only BayesNCL's gates use: NCL and CL build no prior, guide or gating head from them."""


def without_gates(cfg: Config, method: str) -> Config:
    """``cfg`` as a ``method`` run (NCL, CL), its gate fields (:data:`GATE_FIELDS`) back at their defaults.

    The baseline a gated run is judged against: the same data and budget, and no prior of the user's own to import when
    it is opened later.
    """
    default = Config()
    return dataclasses.replace(cfg, method=method, **{f: getattr(default, f) for f in GATE_FIELDS})
