"""The package version, in one place (the consistency check compares it across ranks)."""

__version__ = "0.1.0"
