"""How the program is trained: the ELBO, the gate estimators, BayesNCLHead, the learner.

Modules: density, elbo, estimators, gate_gradients, head, learner.
"""
