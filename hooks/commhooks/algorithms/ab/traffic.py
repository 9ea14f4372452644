"""AB-training's traffic declaration: the calls :class:`~commhooks.algorithms.ab.ABState` makes, step by step.

Registered with the algorithm; the meter tests and ``commhooks plan`` read AB's bytes from here.  The phases
(:mod:`.schedule`, AB x QSR's rule from ``setting.lr``) are known in advance; the factor ranks are not: each
re-basis takes them from the weights' singular values.  So the declaration is exact for given ranks
(``setting.factor_ranks``: layer -> rank as trained, None = kept dense, one mapping for every phase or a list, one
per phase) and otherwise an upper bound (``exact=False``): every layer dense, which no rank exceeds (``m k <= m n``,
``k n <= m n``; ``(m + n) k <= m n`` with ``min_compression_rate >= 1``).  Per rank, ``N`` parameter elements, a
layer seen tall (``m >= n``):

* warm-up and full-rank steps: the world's gradient mean, ``4 N`` (``full-grad``);
* AB steps, in the group (none with ``local_group_steps`` or groups of one): an A-rank ``4 m k`` per compressed
  layer, a B-rank ``4 k n``, and ``4 x`` each dense tensor (``ab-grad``, scope ``group``);
* a re-basis: the ranks' agreement (``8`` bytes per candidate layer) and the factors' checksums (``32`` per
  compressed layer) (``basis``; a broadcast of rank 0's factors where they differ is not declared: it depends on
  the data);
* a sync: ``full`` the weights ``4 N``, ``with-stale`` the factors ``4 (m + n) k`` per compressed layer and the
  dense tensors, with the step proof and buffers (``sync``); a ``payload`` other than fp32 sends the change since
  the phase began by allgather (``proof + codec.nbytes``) or the two-step exchange
  (:func:`~commhooks.algorithms.traffic.body_sends`), and the buffers apart (``sync-buffers``).
"""

from __future__ import annotations

import fnmatch
import math
from typing import Dict, List, Optional

from ..traffic import Send, Setting, Traffic, averaged, body_sends
from .groups import make_groups
from .schedule import AB, ENTER, SYNC, Clock


def _tall(shape) -> tuple:
    m, n = shape[0], math.prod(shape[1:])
    return (m, n) if m >= n else (n, m)


def ab_traffic(config, setting: Setting) -> Traffic:
    """The traffic of ``config`` (a validated ``ABConfig``) for one rank in ``setting``."""
    c, s = config, setting
    groups, roles = make_groups(c, s.world, s.local_world)
    mine = next(i for i, g in enumerate(groups) if s.rank in g)
    role, group_size = roles[mine], len(groups[mine])
    candidates = [n for n, shape in s.shapes if len(shape) >= 2 and not any(
        fnmatch.fnmatchcase(n, pat) for pat in c.full_rank)]
    given = s.factor_ranks
    exact = given is not None
    entries: List[Dict[str, Optional[int]]] = (
        [] if given is None else [dict(r) for r in given] if isinstance(given, (list, tuple)) else [dict(given)])
    n_all = s.numel
    eb = s.element_bytes

    def ranks_at(entry: int) -> Dict[str, Optional[int]]:
        return entries[min(entry, len(entries) - 1)] if entries else {n: None for n in candidates}

    def grad_bytes(ranks) -> int:
        total = 0
        for name, shape in s.shapes:
            k = ranks.get(name)
            if k is None:
                total += math.prod(shape)
            else:
                m, n = _tall(shape)
                total += (m if role == "A" else n) * k
        return eb * total

    def synced_numel(ranks) -> int:
        if c.sync == "full" or not any(v is not None for v in ranks.values()):
            return n_all
        total = 0
        for name, shape in s.shapes:
            k = ranks.get(name)
            total += math.prod(shape) if k is None else sum(_tall(shape)) * k
        return total

    def sync_sends(ranks, phase_began: bool) -> List[Send]:
        numel = synced_numel(ranks)
        if c.payload != "fp32" and phase_began:
            sent, landed = body_sends(c.codec, numel, s.proof_bytes, "sync", "world", s.world)
            out = sent + landed
            return out + (averaged(s.buffers, s, "sync-buffers", "world") if s.buffers else [])
        return averaged(numel + s.buffers, s, "sync", "world")

    def enter_sends(ranks) -> List[Send]:
        compressed = sum(1 for v in ranks.values() if v is not None) if exact else len(candidates)
        out = [Send("allreduce", 8 * len(candidates), "basis", "world")] if candidates else []
        return out + ([Send("allreduce", 32 * compressed, "basis", "world")] if compressed else [])

    full_grad = Send("allreduce", eb * n_all, "full-grad", "world")
    clock, entry = Clock(), 0
    timeline: List[List[Send]] = [[] for _ in range(s.steps)]
    before: List[Send] = []
    sync_steps: List[int] = []
    began = False  # an AB phase's start is held (compressed payloads send the change since)
    typical_step: tuple = ()
    typical_sync: tuple = ()

    def advance(step: int, out: List[Send]) -> None:
        nonlocal entry, began, typical_sync
        for event in clock.advance(step, c):
            if event == SYNC:
                sends = sync_sends(ranks_at(entry - 1), began)
                out += sends
                typical_sync = tuple(sends)
                sync_steps.append(step)
                began = False
            elif event == ENTER:
                out += enter_sends(ranks_at(entry))
                entry += 1
                began = True

    advance(0, before)
    for t in range(s.steps):
        clock.size(t, lambda: s.lr(t), c)
        if clock.phase != AB:
            timeline[t].append(full_grad)
        elif group_size > 1 and not c.local_group_steps:
            timeline[t].append(Send("allreduce", grad_bytes(ranks_at(entry - 1)), "ab-grad", "group"))
            typical_step = (timeline[t][-1],)
        advance(t + 1, timeline[t])
    size_of = {"world": s.world, "group": group_size}
    kept = lambda calls: tuple(x for x in calls if size_of[x.scope] > 1)  # noqa: E731  (groups of one: no call)
    note = "" if exact else ("AB's ranks come from the data: every layer counted dense (an upper bound); give "
                             "factor_ranks for the exact bytes")
    return Traffic([kept(calls) for calls in timeline], kept(typical_step), kept(typical_sync), sync_steps,
                   exact=exact, note=note, before=kept(before), group=group_size)
