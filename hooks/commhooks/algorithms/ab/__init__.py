"""AB-training: low-rank factors trained by independent groups (arXiv 2405.01067)."""

from .config import ABConfig
from .lowrank import Basis, choose_rank, compression_ratio, tall_view
from .rebound import LRRebound
from .schedule import phases
from .state import ABState

__all__ = ["ABConfig", "ABState", "LRRebound", "Basis", "choose_rank", "compression_ratio", "tall_view", "phases"]
