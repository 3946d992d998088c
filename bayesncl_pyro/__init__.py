"""BayesNCL (Bayesian gated non-negative contrastive learning) as a Pyro program, with NCL and SimCLR.

``from bayesncl_pyro import BayesNCLHead`` (the gates as a loss module for your own loop, ``head.py``) and
``from bayesncl_pyro import load_run`` (a trained run folder as an object, ``run.py``).
"""

__version__ = "0.3.0"
__all__ = ["BayesNCLHead", "load_run"]


def __getattr__(name: str):
    # loaded on first use: `import bayesncl_pyro` (and every submodule's import of __version__) stays free of
    # torch and Pyro
    if name == "BayesNCLHead":
        from bayesncl_pyro.head import BayesNCLHead

        return BayesNCLHead
    if name == "load_run":
        from bayesncl_pyro.run import load_run

        return load_run
    raise AttributeError(f"module 'bayesncl_pyro' has no attribute {name!r}")
