"""commhooks: communication-efficient training hooks for PyTorch DDP, Horovod and DeepSpeed.

Public names only; see the README for usage.
"""

from . import ab, ddp
from ._version import __version__
from .ab import ABState, LRRebound
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .comm import CollectiveError
from .consistency import DivergenceError, NonFiniteError
from .config import ABConfig, ConfigError, QSRConfig, load_config
from .ddp import ab_hook, allreduce_hook, qsr_hook
from .qsr import QSRState, qsr_period


__all__ = [
    "__version__",
    "ab",
    "ddp",
    "ABConfig",
    "ABState",
    "LRRebound",
    "ab_hook",
    "ConfigError",
    "CollectiveError",
    "DivergenceError",
    "NonFiniteError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "QSRConfig",
    "QSRState",
    "load_config",
    "qsr_hook",
    "qsr_period",
    "allreduce_hook",
]
