"""Algorithms: plain tensor math over a :class:`~commhooks.comm.Comm`; no engine, no environment.

Packages, read in this order: :mod:`.contract` (what every algorithm is and how the engines drive it), :mod:`.qsr`
and :mod:`.ab` (the two algorithms), :mod:`.payload` (compressed means, which both call); beside them
:mod:`.averaging` (what a sync averages), :mod:`.replicas` (replica groups) and :mod:`.traffic` (the declarations of
bytes every algorithm registers).  The built-in algorithms are registered by the package's entry
(``commhooks/__init__.py``): this layer sits below the registry and imports it nowhere.
"""

from ..facts import EngineFacts
from . import ab, qsr
from .contract import AlgorithmState

__all__ = ["AlgorithmState", "EngineFacts", "ab", "qsr"]
