"""The package's version, its one home: pyproject.toml reads it, every checkpoint and report records it."""

__version__ = "0.3.0"
