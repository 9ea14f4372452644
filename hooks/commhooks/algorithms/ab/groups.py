"""Which ranks train which factor: contiguous groups, first half A, second half B."""

from __future__ import annotations

from typing import List, Optional, Tuple

from ...settings import ConfigError
from ..replicas import contiguous_groups, resolve_size
from .config import ABConfig


def resolve_group_size(config: ABConfig, world: int, local_world: Optional[int]) -> int:
    """``None`` -> ranks per node (the whole world when unknown), ``-1`` -> half of the world.

    AB's groups are replica groups (:mod:`commhooks.algorithms.replicas`) with one more rule: A or B per group.
    """
    if config.mode == "only-b":
        return world
    if config.group_size == -1:
        return max(1, world // 2)
    return resolve_size(config.group_size, world, local_world)


def make_groups(config: ABConfig, world: int, local_world: Optional[int]) -> Tuple[List[Tuple[int, ...]], List[str]]:
    """The groups (tuples of ranks) and their roles (``"A"`` or ``"B"``).

    ``groups`` mode: ``world // group_size`` contiguous groups; the first ``n // 2`` train A, the rest train B.
    ``only-b``: one group, the whole world, trains B.
    """
    size = resolve_group_size(config, world, local_world)
    if config.mode == "only-b":
        return [tuple(range(world))], ["B"]
    if world < 2:
        raise ConfigError(
            f"ab.mode 'groups' needs at least 2 ranks (one A group and one B group), got a world of {world}; "
            "use mode 'only-b' on a single rank (e.g. to resume or evaluate), or start 2 or more ranks"
        )
    if world % size != 0 or world // size < 2:
        origin = {None: " (ranks per node, LOCAL_WORLD_SIZE)", -1: " (half the world)"}.get(config.group_size, "")
        raise ConfigError(
            f"ab.group_size {size}{origin} must divide the {world} ranks into at least two groups in 'groups' mode; "
            f"use a group_size that divides {world} into >= 2 parts (1 or -1 always do), or mode 'only-b'"
        )
    groups = contiguous_groups(size, world, "ab.group_size")
    n = len(groups)
    roles = ["A" if i < n // 2 else "B" for i in range(n)]
    return groups, roles
