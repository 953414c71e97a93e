"""The package version: the one definition (``pyproject.toml`` reads it; ``dtkv.__version__`` re-exports it)."""

__version__ = "0.2.0"
