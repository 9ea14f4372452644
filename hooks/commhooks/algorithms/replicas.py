"""Replica groups: contiguous blocks of ranks that train as one replica (typically a node).

Inside a replica group the engine's usual data parallelism runs every step (the fast links); across groups a local
method averages every so often (the slow links).  QSR's ``group_size`` and AB's groups are the same split, made
here: ``group_size`` ranks per group, ``None`` = ranks per node (from the launcher; the whole world when unknown).
PyTorch's fixed-period version of the idea is ``hierarchical_model_averager``; here the period follows the quadratic
rule.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..settings import ConfigError


def resolve_size(group_size: Optional[int], world: int, local_world: Optional[int]) -> int:
    """``None`` -> ranks per node (the whole world when unknown), otherwise ``group_size``."""
    return (local_world or world) if group_size is None else group_size


def contiguous_groups(size: int, world: int, key: str, origin: str = "") -> List[Tuple[int, ...]]:
    """``world // size`` blocks of ``size`` consecutive ranks; ConfigError naming ``key`` if it does not divide."""
    if size < 1 or world % size:
        raise ConfigError(f"{key} {size}{origin} must divide the {world} ranks into equal groups; "
                          f"use a divisor of {world} (1 = every rank its own replica)")
    return [tuple(range(i * size, (i + 1) * size)) for i in range(world // size)]


def group_of(groups: List[Tuple[int, ...]], rank: int) -> int:
    """Index of the group holding ``rank``."""
    return next(i for i, g in enumerate(groups) if rank in g)


def across_groups(groups: List[Tuple[int, ...]]) -> List[Tuple[int, ...]]:
    """The i-th rank of every group, for each i: where a shard held by one rank of a group meets the same
    shard of the other groups."""
    return [tuple(g[i] for g in groups) for i in range(len(groups[0]))]
