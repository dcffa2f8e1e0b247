"""The package version (single source: pyproject.toml mirrors it)."""

__version__ = "0.1.0"
