"""Plain PyTorch, no Pyro: the backbones and MLPs, the contrastive maths, the optimizers.

Modules: encoders, gradient_scale, losses, optim.
"""
