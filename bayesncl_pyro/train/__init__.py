"""The training loop: a Config made whole, the trainer, its guard and monitor; a comparison's runs and their epochs.

Modules: budget, guard, monitor, plan, resolve, trainer.
"""
