"""commhooks: communication-efficient training hooks for PyTorch DDP, Horovod and DeepSpeed.

Public names only; see the documentation (docs/, `make docs`) for usage.  Layers, bottom up (an import goes
down only; ``tests/test_layers.py`` checks it): ``settings`` (the :class:`HookConfig` base,
:class:`ConfigError`) and ``shipped``; ``comm`` (collectives + byte meter) and ``launch``; ``facts`` (what an
engine hands an algorithm); ``algorithms`` (``qsr``, ``ab``, the :class:`AlgorithmState` contract); the
``registry``; ``config`` (loading a config by its ``type``); the engine adapters ``ddp``, ``fsdp``, ``horovod``,
``deepspeed`` (the last two import their engine only when used) and ``checkpoint`` (with the
``checkpointer`` that saves on a schedule); ``integrations``;
``tools`` (trainer, benchmark) needs the ``commhooks[tools]`` extra.

This module, the package's entry, registers the built-in algorithms (qsr first, then ab: the registry lists
them in that order): it is the one place above both the algorithms and the registry, and Python runs it
before any ``commhooks`` submodule, so every state class has its ``name`` and ``config_class`` by the time
anything can build one.
"""

from . import ddp, fsdp, launch  # noqa: F401  (public submodules: commhooks.ddp.register, commhooks.fsdp.register, commhooks.launch.init_distributed)
from ._version import __version__
from .algorithms import ab, qsr
from .algorithms.ab import ABConfig, ABState, LRRebound
from .algorithms.ab.traffic import ab_traffic as _ab_traffic
from .algorithms.contract import AlgorithmState
from .algorithms.contract.checks import DivergenceError, NonFiniteError
from .algorithms.qsr import QSRConfig, QSRState, qsr_period
from .algorithms.qsr.traffic import qsr_traffic as _qsr_traffic
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .checkpointer import Checkpointer
from .comm import CollectiveError
from .config import ConfigError, HookConfig, load_config
from .ddp import allreduce_hook, comm_hook
from .facts import EngineFacts
from .registry import register_algorithm

# the built-ins, in the order the registry lists them
register_algorithm(QSRConfig, QSRState, traffic=_qsr_traffic)
register_algorithm(ABConfig, ABState, traffic=_ab_traffic)

# the per-algorithm names of earlier releases: every algorithm now uses the one DDP hook
qsr_hook = ab_hook = comm_hook

__all__ = [
    "__version__",
    "ab",
    "ddp",
    "fsdp",
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
    "Checkpointer",
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
