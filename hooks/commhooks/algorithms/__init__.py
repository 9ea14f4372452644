"""Algorithms: plain tensor math over a :class:`~commhooks.comm.Comm`; no engine, no environment.

The built-in algorithms (``qsr``, ``ab``) are registered by the package's entry (``commhooks/__init__.py``):
this layer sits below the registry and imports it nowhere.
"""

from ..facts import EngineFacts
from . import ab, qsr
from .base import AlgorithmState

__all__ = ["AlgorithmState", "EngineFacts", "ab", "qsr"]
