"""The Pyro guides: the amortized q(g | x) of the gates."""
