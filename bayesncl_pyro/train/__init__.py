"""The training loop: a Config made whole, the trainer, its guard and its monitor.

Modules: guard, monitor, resolve, trainer."""
