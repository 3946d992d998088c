"""The training loop: a Config made whole, the trainer, its guard and monitor, and the epochs for a time budget.

Modules: budget, guard, monitor, resolve, trainer.
"""
