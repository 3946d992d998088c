"""BayesNCL (Bayesian gated non-negative contrastive learning) as a Pyro program, with NCL and SimCLR.

``from bayesncl_pyro import BayesNCLHead`` (the gates as a loss module for your own training loop) and
``from bayesncl_pyro import load_run`` (a trained run folder as an object).

The pipeline: dataset -> views -> encoder -> (model, guide) -> ELBO -> optimizer; evaluation reads checkpoints.
Its layers, from the ground up; a module imports only from its own layer and from the layers listed before it
(tests/test_imports.py reads this list and checks it):

    *.py        the leaves: _version, errors, config, plugins, device, distributed, rundir, loggers
    data/       dataset -> images -> two augmented views per image, on the CPU or the training device
    nn/         plain PyTorch: backbones and MLPs, the contrastive maths, optimizers
    models/     the Pyro model: gates from a prior, InfoNCE on gated features as a likelihood factor
    guides/     the Pyro guide: q(g | x) from a gating head on the backbone's features
    infer/      how the program learns: the ELBO, the gate estimators, BayesNCLHead, the learner
    evaluate/   what a trained run says: metrics, probes, the test split's features, diagnostics, report, load_run;
                several runs side by side
    train/      the loop: a Config made whole, the trainer, its guard, its monitor; the epochs a time budget allows
    cli/        the scripts' main(argv): flags in, the layers below called, figures out

models/ and guides/ sit at the top of the repository, where the Pyro program is looked for, and install as
bayesncl_pyro.models and bayesncl_pyro.guides.
"""

from bayesncl_pyro._version import __version__

__all__ = ["BayesNCLHead", "load_run"]


def __getattr__(name: str):
    # loaded on first use: `import bayesncl_pyro` stays free of torch and Pyro
    if name == "BayesNCLHead":
        from bayesncl_pyro.infer.head import BayesNCLHead

        return BayesNCLHead
    if name == "load_run":
        from bayesncl_pyro.evaluate.run import load_run

        return load_run
    raise AttributeError(f"module 'bayesncl_pyro' has no attribute {name!r}")
