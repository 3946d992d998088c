"""The training loop: a Config made whole, the trainer, its guard and its monitor, and the epochs that fit a time
budget.

Modules: budget, guard, monitor, resolve, trainer."""
