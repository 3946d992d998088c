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
                posterior (the last two: the old paths of moved names, until they go)
    data/       dataset -> images -> two augmented views per image, on the CPU or the training device
    nn/         plain PyTorch: backbones and MLPs, the contrastive maths, optimizers
    models/     the Pyro model: gates from a prior, InfoNCE on gated features as a likelihood factor
    guides/     the Pyro guide: q(g | x) from a gating head on the backbone's features
    infer/      how the program learns: the ELBO, the gate estimators, BayesNCLHead, the learner
    evaluate/   what a trained run says: metrics, probes, the test split's features, diagnostics, report, loading a run;
                several runs side by side
    train/      the loop: a Config made whole, the trainer, its guard, its monitor; the epochs a time budget allows
    cli/        the scripts' main(argv): flags in, the layers below called, figures out

models/ and guides/ sit at the top of the repository, where the Pyro program is looked for, and install as
bayesncl_pyro.models and bayesncl_pyro.guides.
"""

from bayesncl_pyro._version import __version__ as __version__  # re-exported: the package's version

__all__ = ["BayesNCLHead", "Config", "PRIORS", "Prior", "Trainer", "export_gates", "gate_posterior", "load_run",
           "read_gates", "register"]


def __getattr__(name: str):
    # each import here is late: loaded on first use, `import bayesncl_pyro` stays free of torch and Pyro
    if name == "BayesNCLHead":
        from bayesncl_pyro.infer.head import BayesNCLHead  # late: see above

        return BayesNCLHead
    if name == "Config":
        from bayesncl_pyro.config import Config  # late: see above

        return Config
    if name == "Trainer":
        from bayesncl_pyro.train.trainer import Trainer  # late: see above

        return Trainer
    if name == "load_run":
        from bayesncl_pyro.evaluate.run import load_run  # late: see above

        return load_run
    if name == "gate_posterior":
        from bayesncl_pyro.evaluate.dimensions import gate_posterior  # late: see above

        return gate_posterior
    if name == "export_gates":
        from bayesncl_pyro.evaluate.arviz_export import export_gates  # late: see above

        return export_gates
    if name == "read_gates":
        from bayesncl_pyro.evaluate.arviz_export import read_gates  # late: see above

        return read_gates
    if name == "Prior":
        from bayesncl_pyro.models.priors import Prior  # late: see above

        return Prior
    if name == "PRIORS":
        from bayesncl_pyro.models.priors import PRIORS  # late: see above

        return PRIORS
    if name == "register":
        from bayesncl_pyro.models.priors import register  # late: see above

        return register
    raise AttributeError(f"module 'bayesncl_pyro' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
