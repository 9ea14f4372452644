"""commhooks: communication-efficient training hooks for PyTorch DDP, Horovod and DeepSpeed.

Public names only; see the README for usage.
"""

from . import ab, ddp
from .ab import ABState, LRRebound
from .config import ABConfig, ConfigError, QSRConfig, load_config
from .ddp import ab_hook, allreduce_hook, qsr_hook
from .qsr import QSRState, qsr_period

__version__ = "0.1.0"

__all__ = [
    "ABConfig",
    "ABState",
    "LRRebound",
    "ab_hook",
    "ConfigError",
    "QSRConfig",
    "QSRState",
    "load_config",
    "qsr_hook",
    "qsr_period",
    "allreduce_hook",
]
