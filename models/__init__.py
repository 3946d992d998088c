"""The Pyro models: the contrastive program and the swappable priors over its gates."""
