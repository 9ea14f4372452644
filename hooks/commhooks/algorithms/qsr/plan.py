"""What a QSR sync covers, decided once at set-up: the :class:`SyncPlan` the state and its traffic declaration read.

:class:`SyncPlan`, frozen from the config, the world and the engine's facts: the replica groups; whether this rank
syncs a *part* (``hierarchical``) or the *shard* an engine sharding inside the group handed over; an outer step or a
plain mean; the fragments' sizes.  Fragments cut the concatenated parameters into F runs of equal length (a run may
end inside a tensor, so a model of a few large tensors, or DeepSpeed's one flat partition, still splits evenly):
:func:`split_fragments`.  And :func:`check_layout`, the local checks of those settings against the tensors.  Pure
Python: no tensor is touched here.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import List, Optional, Sequence, Tuple

from ...settings import ConfigError
from .. import replicas
from ..contract.parameters import user_stacklevel

Run = List[Tuple[int, int, int]]  # pieces (tensor index, start, end) of one run of concatenated tensors


def runs(total: int, count: int) -> List[int]:
    """Lengths of ``count`` equal runs (up to one element) of ``total`` elements."""
    edges = [total * k // count for k in range(count + 1)]
    return [b - a for a, b in zip(edges[:-1], edges[1:])]


def split_fragments(sizes: Sequence[int], count: int) -> List[Run]:
    """The concatenation of tensors of ``sizes`` elements cut into the :func:`runs` of ``count``; each run as
    pieces ``(tensor index, start, end)``."""
    out, lo = [], 0
    for length in runs(sum(sizes), count):
        pieces, offset, hi = [], 0, lo + length
        for i, n in enumerate(sizes):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                pieces.append((i, a - offset, b - offset))
            offset += n
        out.append(pieces)
        lo = hi
    return out


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """What a QSR sync covers and how it travels, for one rank; built by :meth:`build`.

    ``groups``: the replica groups (tuples of ranks); ``group``: this rank's; ``members``: its ranks;
    ``member``: this rank's place there.  ``hierarchical``: this rank syncs its ``1/g`` part of the replica's
    parameters with the same part of the other groups, and shares it inside the group afterwards.
    ``engine_sharded``: the engine shards inside the group and handed over this rank's shard, synced with the
    same shard of the other groups.  ``sharded``: either (the sync spans ``across``, one rank of each group, its
    ``scope``).  ``outer_step``: a sync is an outer step on the pseudo-gradient (any ``outer_*`` key, a payload,
    overlap, fragments, or an ``outer_optimizer``), else a plain mean of the weights; ``streaming``: a round may
    end with the weights apart (overlap, fragments).  ``numel``: the elements this rank holds;
    ``fragment_numels``: what each fragment of the part it sends holds, ``part_numel`` their sum."""

    groups: Tuple[Tuple[int, ...], ...]
    group: int
    members: Tuple[int, ...]
    member: int
    hierarchical: bool
    engine_sharded: bool
    sharded: bool
    scope: str
    outer_step: bool
    streaming: bool
    numel: int
    fragment_numels: Tuple[int, ...]
    part_numel: int

    @classmethod
    def build(cls, config, world: int, rank: int, local_world: Optional[int], engine_data_parallel: bool,
              numel: int, outer_optimizer: bool = False, origin: str = "") -> "SyncPlan":
        """The plan of ``config`` (a QSR config) for ``rank`` of ``world``; ``numel``: the elements of the tensors
        the state holds (the engine's shard where it shards).  Local: no collective."""
        size = replicas.resolve_size(config.group_size, world, local_world)
        groups = [tuple(g) for g in replicas.contiguous_groups(size, world, "qsr.group_size", origin)]
        mine = groups[replicas.group_of(groups, rank)]
        engine_sharded = engine_data_parallel and len(mine) > 1
        hierarchical = config.hierarchical and len(mine) > 1 and not engine_data_parallel
        part = runs(numel, len(mine))[mine.index(rank)] if hierarchical else numel
        sharded = hierarchical or engine_sharded
        return cls(tuple(groups), groups.index(mine), mine, mine.index(rank), hierarchical, engine_sharded, sharded,
                   "across" if sharded else "world", config.pseudo_gradient or outer_optimizer, config.streaming,
                   numel, tuple(runs(part, config.fragments)), part)


def check_layout(config, named_params, hierarchical: bool) -> None:
    """Local checks of ``hierarchical`` / ``fragments`` / ``overlap_steps`` against the tensors: a part or a
    fragment is a view of contiguous parameters (ConfigError on every rank alike); an overlap as long as the
    shortest period hides less than asked (a warning)."""
    c = config
    bent = [n for n, p in named_params if not p.is_contiguous()]

    def require_contiguous(what: str, piece: str, instead: str) -> None:
        if bent:
            raise ConfigError(f"{what} needs contiguous parameters ({piece} is a view of them); not contiguous: "
                              f"{bent[:4]} (e.g. channels_last): use {instead}")

    if hierarchical:
        require_contiguous("qsr.hierarchical", "a rank's part", "hierarchical false")
    numel = sum(p.numel() for _, p in named_params)
    if c.fragments > 1 and c.fragments > numel:
        raise ConfigError(f"qsr.fragments must be <= the {numel} synced elements, got {c.fragments}")
    if c.fragments > 1:
        require_contiguous("qsr.fragments > 1", "a fragment", "fragments 1")
    if c.overlap_steps >= c.h_base:
        warnings.warn(
            f"QSR: overlap_steps={c.overlap_steps} >= h_base={c.h_base}: at periods of {c.overlap_steps} steps or "
            "fewer a sync is still in flight when the next one is due, so it lands first (the rank waits for it) "
            f"and the overlap hides less than asked; use overlap_steps < h_base (e.g. {max(1, c.h_base // 2)})",
            stacklevel=user_stacklevel())
