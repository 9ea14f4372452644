"""commhooks: communication-efficient training hooks for PyTorch DDP, Horovod and DeepSpeed.

Public names only; see the documentation (docs/, `make docs`) for usage.  Layers, bottom up: ``comm``
(collectives + byte meter), ``config`` and ``registry``, ``algorithms``
(``qsr``, ``ab``, the :class:`AlgorithmState` contract), the engine adapters
``ddp``, ``horovod``, ``deepspeed`` (the last two import their engine only
when used), ``launch`` and ``checkpoint``; ``tools`` (trainer, benchmark)
needs the ``commhooks[tools]`` extra.
"""

from . import ddp, launch  # noqa: F401  (public submodules: commhooks.ddp.register, commhooks.launch.init_distributed)
from ._version import __version__
from .algorithms import ab, qsr
from .algorithms.ab import ABConfig, ABState, LRRebound
from .algorithms.base import AlgorithmState, EngineFacts
from .algorithms.consistency import DivergenceError, NonFiniteError
from .algorithms.qsr import QSRConfig, QSRState, qsr_period
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .comm import CollectiveError
from .config import ConfigError, HookConfig, load_config
from .ddp import allreduce_hook, comm_hook
from .registry import register_algorithm

# the per-algorithm names of earlier releases: every algorithm now uses the one DDP hook
qsr_hook = ab_hook = comm_hook

__all__ = [
    "__version__",
    "ab",
    "ddp",
    "qsr",
    "AlgorithmState",
    "EngineFacts",
    "HookConfig",
    "register_algorithm",
    "ABConfig",
    "ABState",
    "LRRebound",
    "ab_hook",
    "ConfigError",
    "CollectiveError",
    "DivergenceError",
    "NonFiniteError",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "QSRConfig",
    "QSRState",
    "load_config",
    "comm_hook",
    "qsr_hook",
    "qsr_period",
    "allreduce_hook",
]
