"""BayesNCL (Bayesian gated non-negative contrastive learning) as a Pyro program, with NCL and SimCLR.

The public API, importable from here (each loaded on first use, so ``import bayesncl_pyro`` loads neither torch nor
Pyro); these names stay here when modules move:

    BayesNCLHead                the gates as a loss module for your own training loop
    Config, Trainer             a run's settings, and the loop that trains it into a run folder
    load_run                    a trained run folder as an object
    gate_posterior              the gate posterior of a run folder (or a learner) on its test split
    export_gates, read_gates    that posterior as ArviZ data in a run's ``gates.nc``
    Prior, PRIORS, register     the base class of the priors, their registry by ``--prior`` name, its decorator

The pipeline: dataset -> views -> encoder -> (model, guide) -> ELBO -> optimizer; evaluation reads checkpoints.
Its layers, from the ground up; a module imports only from its own layer and from the layers listed before it
(tests/test_imports.py reads this list and checks it):

    *.py        the leaves: _version, errors, config, plugins, device, distributed, rundir, loggers, _deprecated,
                posterior (the last two: the old paths of moved names, until they go); rundir is a package
                of this layer, split by idea
    data/       dataset -> images -> two augmented views per image, on the CPU or the training device
    nn/         plain PyTorch: backbones and MLPs, the contrastive maths, optimizers
    models/     the Pyro model: gates from a prior, InfoNCE on gated features as a likelihood factor
    guides/     the Pyro guide: q(g | x) from a gating head on the backbone's features
    infer/      how the program learns: the ELBO, the gate estimators, BayesNCLHead, the learner
    evaluate/   what a trained run says: metrics, probes, the test split's features, diagnostics, report, loading a run;
                several runs side by side
    train/      the loop: a Config made whole, the trainer, its guard, its monitor; a comparison's runs and the epochs
                a time budget allows
    cli/        the scripts' main(argv): flags in, the layers below called, figures out

models/ and guides/ sit at the top of the repository, where the Pyro program is looked for, and install as
bayesncl_pyro.models and bayesncl_pyro.guides.
"""

import importlib

from bayesncl_pyro._version import __version__ as __version__  # re-exported: the package's version

# the public names and their modules, imported on first use (PEP 562): `import bayesncl_pyro` stays free of torch and
# Pyro, and a name keeps working here when its module moves
_PUBLIC = {
    "BayesNCLHead": "bayesncl_pyro.infer.head",
    "Config": "bayesncl_pyro.config",
    "Trainer": "bayesncl_pyro.train.trainer",
    "load_run": "bayesncl_pyro.evaluate.run",
    "gate_posterior": "bayesncl_pyro.evaluate.posterior",
    "export_gates": "bayesncl_pyro.evaluate.arviz_export",
    "read_gates": "bayesncl_pyro.evaluate.arviz_export",
    "Prior": "bayesncl_pyro.models.priors",
    "PRIORS": "bayesncl_pyro.models.priors",
    "register": "bayesncl_pyro.models.priors",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'bayesncl_pyro' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
