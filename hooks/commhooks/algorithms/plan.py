"""QSR's sync, decided once: the plan of what a sync covers, and the timeline of a step as a value.

Two readers need the same answers, and both read them here: the state that runs
the syncs (:mod:`.qsr` with :mod:`.sync`) and the traffic declaration that states
their bytes (:mod:`.qsr_traffic`: the meter tests, ``commhooks plan``, the docs).

* :class:`SyncPlan`, frozen at set-up from the config, the world and the engine's
  facts: the replica groups; whether this rank syncs a *part* (``hierarchical``)
  or the *shard* an engine sharding inside the group handed over; an outer step
  or a plain mean; the fragments' sizes.
* :func:`step_events`, a function of (step, config, what is in flight): the
  events of one optimizer step, in the order they run.

**Timeline** of one QSR round with ``fragments=3, overlap_steps=1`` and a
period ``H=6`` (steps of the round; ``sN``: fragment N sent after that step,
``lN``: it lands after that step, before the next optimizer step)::

    step of round   1    2    3    4    5    6  | 1 (next round)
    sent                 s0        s1        s2 |
    landed                    l0        l1      | l2
    optimizer step  k+1  k+2  k+3  k+4  k+5  k+6  k+7

Fragment ``k`` of ``F`` is sent after step ``ceil(H (k + 1) / F)`` of the round
(:func:`send_points`) and lands ``overlap_steps`` steps later, never after
``total_steps`` (the last round of a known run ends with every fragment sent and
landed at once: the ranks end identical).  A fragment whose previous sync is
still in flight lands before it is sent again.  With ``fragments=1,
overlap_steps=0`` this is one blocking sync at the round's end, the plain case.
The logger ``commhooks`` at DEBUG prints one line per fragment sent and landed
("QSR step 2: fragment 0 sent, lands after step 3"; a test reads this table and
compares it with those lines).

Fragments cut the concatenated parameters into F runs of equal length (a run may
end inside a tensor, so a model of a few large tensors, or DeepSpeed's one flat
partition, still splits evenly): :func:`split_fragments`.  Pure Python: no tensor
is touched here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from . import replicas

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


def row_shard_numel(shapes: Sequence[Sequence[int]], count: int, member: int) -> int:
    """Elements of the ``member``-th of ``count`` row shards of tensors of ``shapes``: each tensor's dim 0 cut as
    ``torch.chunk`` cuts it (chunks of ``ceil(rows / count)``, the last ones shorter or empty), as FSDP2 shards."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        chunk = math.ceil(rows / count)
        total += max(0, min(chunk, rows - member * chunk)) * (math.prod(shape[1:]) if shape else 1)
    return total


def run_views(tensors: Sequence, pieces: Run) -> list:
    """The pieces of a run of ``tensors`` as flat views that share their storage (writes land in the tensors)."""
    return [tensors[i].detach().view(-1)[a:b] for i, a, b in pieces]


def split_views(tensors: Sequence, count: int, k: int) -> list:
    """Run ``k`` of ``count`` equal runs of the concatenation of ``tensors``, as views."""
    return run_views(tensors, split_fragments([t.numel() for t in tensors], count)[k])


def send_points(period: int, count: int) -> Dict[int, List[int]]:
    """Step of the round (1..period) -> fragments sent after it; the last fragment at ``period``."""
    points: Dict[int, List[int]] = {}
    for k in range(count):
        points.setdefault(max(1, math.ceil(period * (k + 1) / count)), []).append(k)
    return points


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """What a QSR sync covers and how it travels, for one rank; built by :meth:`build`.

    ``groups``: the replica groups (tuples of ranks); ``group``: this rank's; ``member``: its place there.
    ``hierarchical``: this rank syncs its ``1/g`` part of the replica's parameters with the same part of the
    other groups, and shares it inside the group afterwards.  ``engine_sharded``: the engine shards inside the
    group and handed over this rank's shard, synced with the same shard of the other groups.  ``outer_step``:
    a sync is an outer step on the pseudo-gradient (any ``outer_*`` key, a payload, overlap, fragments, or an
    ``outer_optimizer``), else a plain mean of the weights.  ``numel``: the elements this rank holds;
    ``fragment_numels``: what each fragment of the part it sends holds."""

    groups: Tuple[Tuple[int, ...], ...]
    group: int
    member: int
    hierarchical: bool
    engine_sharded: bool
    outer_step: bool
    streaming: bool
    numel: int
    fragment_numels: Tuple[int, ...]

    @classmethod
    def build(cls, config, world: int, rank: int, local_world: Optional[int], engine_data_parallel: bool,
              numel: int, outer_optimizer: bool = False, origin: str = "") -> "SyncPlan":
        """The plan of ``config`` (a QSR config) for ``rank`` of ``world``; ``numel``: the elements of the tensors
        the state holds (the engine's shard where it shards).  Local: no collective."""
        size = replicas.resolve_size(config.group_size, world, local_world)
        groups = replicas.contiguous_groups(size, world, "qsr.group_size", origin)
        mine = groups[replicas.group_of(groups, rank)]
        engine_sharded = engine_data_parallel and len(mine) > 1
        hierarchical = config.hierarchical and len(mine) > 1 and not engine_data_parallel
        part = runs(numel, len(mine))[mine.index(rank)] if hierarchical else numel
        return cls(tuple(map(tuple, groups)), groups.index(mine), mine.index(rank), hierarchical, engine_sharded,
                   config.pseudo_gradient or outer_optimizer, config.streaming, numel,
                   tuple(runs(part, config.fragments)))

    @property
    def members(self) -> Tuple[int, ...]:
        """The ranks of this rank's replica group."""
        return self.groups[self.group]

    @property
    def sharded(self) -> bool:
        """This rank syncs a part or a shard, over the same one of the other groups (``across``)."""
        return self.hierarchical or self.engine_sharded

    @property
    def scope(self) -> str:
        return "across" if self.sharded else "world"

    @property
    def part_numel(self) -> int:
        return sum(self.fragment_numels)


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing a step does: ``land`` fragment k; ``close`` the round (parameters that joined are taken in);
    ``send`` fragment k, landing after step ``at``; ``end`` the round (``complete``: every rank now holds the
    same weights)."""

    kind: str
    fragment: int = 0
    at: int = 0
    complete: bool = False


def lands_at(config, step: int, blocking: bool) -> int:
    """The step a sync sent after ``step`` lands at: ``overlap_steps`` later, never past ``total_steps``."""
    at = step if blocking else step + config.overlap_steps
    total = config.total_steps
    return at if total is None else min(at, max(step, total))


def ends_run(config, step: int) -> bool:
    """At optimizer ``step`` the run's last round closes: streamed syncs end with one blocking sync of all."""
    return config.streaming and config.total_steps is not None and step >= config.total_steps


def step_events(step: int, since: int, period: int, in_flight: Mapping[int, int], config,
                force: bool = False) -> List[Event]:
    """The events of optimizer ``step``, step ``since`` of a round of ``period``, with ``in_flight`` (fragment ->
    the step it lands at) in flight, in the order they run; ``force``: a sync of everything now (``sync()``).

    Syncs due land first; a round that ends closes, sends its last fragments (the run's last round, or a forced
    sync: every fragment, blocking, after everything in flight has landed) and ends; otherwise the fragments
    due at this step of the round are sent."""
    flying = dict(in_flight)
    events: List[Event] = []

    def land(k: int) -> None:
        events.append(Event("land", k))
        flying.pop(k)

    ending = force or since >= period
    blocking = force or (ending and ends_run(config, step))  # every fragment, sent and landed now
    # syncs that are due land first (all of them, in fragment order, for a forced sync); then, for a blocking
    # end, the rest: two passes, because that is the order the collectives run in
    for k in sorted(flying) if force else sorted(k for k, at in in_flight.items() if at <= step):
        land(k)
    if blocking:
        for k in sorted(flying):
            land(k)
    if ending:
        events.append(Event("close"))
    sends = list(range(config.fragments)) if blocking else send_points(period, config.fragments).get(
        period if ending else since, [])
    for k in sends:
        if k in flying:
            land(k)
        at = lands_at(config, step, blocking)
        events.append(Event("send", k, at))
        if at <= step:
            events.append(Event("land", k))
        else:
            flying[k] = at
    if ending:
        events.append(Event("end", complete=blocking or not config.streaming))
    return events
