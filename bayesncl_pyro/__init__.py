"""BayesNCL (Bayesian gated non-negative contrastive learning) as a Pyro program, with NCL and SimCLR."""

__version__ = "0.1.0"
