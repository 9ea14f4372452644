"""Algorithms: plain tensor math over a :class:`~commhooks.comm.Comm`; no engine, no environment.

Importing this package registers the built-in algorithms (``qsr``, ``ab``).
"""

from . import qsr, ab  # noqa: I001  (registration order: qsr first)
from .base import AlgorithmState, EngineFacts

__all__ = ["AlgorithmState", "EngineFacts", "ab", "qsr"]
