"""Streamed outer syncs: the model in fragments whose syncs are staggered, each overlapped with local steps.

Douillard et al., "Streaming DiLoCo with overlapping communication",
arXiv 2501.18512; torchft's ``local_sgd.DiLoCo`` (``fragment_sync_delay``).

A blocking sync stops compute while the link works, and the link idles
while the ranks compute.  Two changes hide it:

**Overlap** (``overlap_steps`` = tau).  At a sync step ``s`` each rank sends
its pseudo-gradient ``delta_i = anchor - theta_i(s)`` and keeps training; the
averaged ``d`` is applied at step ``s + tau``, when the weights have moved on
by the local progress ``p_i = theta_i(s + tau) - theta_i(s)``::

    anchor <- anchor - outer_lr * outer_step(d)          (same on every rank)
    theta_i <- anchor + alpha * p_i                     merge "progress" (default, alpha 1)
    theta_i <- alpha * theta_i(s + tau) + (1 - alpha) * anchor   merge "mix" (the paper's)

``"progress"`` keeps the tau local steps on top of the synced weights: with
``alpha = 1`` nothing a rank computed is thrown away, and the next
pseudo-gradient (taken against the new anchor) carries ``p_i`` into the next
average.  ``"mix"`` is Streaming DiLoCo's mixing of local and global weights
(the paper's alpha 0.5); ``alpha = 0`` in either is torchft's choice (restore
the global weights, discard the in-flight steps).  The ranks differ by their
local progress after an overlapped merge, so ``check_every`` compares the
anchors, which every rank updates identically.

**Fragments** (``fragments`` = F).  The parameters, concatenated, are cut
into F contiguous runs of equal size (a run may end inside a tensor); in a round of ``H`` steps fragment
``k`` is sent after step ``ceil(H * (k + 1) / F)`` of the round (the last at
the round's end), so the link carries ``1/F`` of the model at a time and a
short overlap suffices to hide each piece.  Each fragment has its own
anchor, outer momentum and error-feedback residual: the outer step is
element-wise, so F fragments synced together equal one sync of the whole
(exactly in fp32; int8's scale blocks restart at each fragment's start).

Rules that keep every rank on the same schedule: a fragment whose previous
sync is still in flight is applied before it is sent again (so ``tau``
longer than a period shrinks to the period); an apply never lands after
``total_steps``, and the last round there ends with a blocking sync of every
fragment (identical weights); ``QSRState.flush`` lands everything in flight
(a forced ``sync()`` and the end of a Join start with it).  A checkpoint taken while syncs are in flight waits for their
results and saves them with the step they apply at: resume is exact.

The fragment geometry lives here; the timeline (which fragment is sent and
lands at which step) and the fragments in flight are the sync pipeline's
(:mod:`.pipeline`: ``RoundSchedule``, ``OuterSteps``).

Tuning: tau should cover the sync's transfer time in steps of compute
(``commhooks plan`` gives both); tau 1-5 with F 1-4 is the paper's range.
Keep ``tau`` below the shortest period QSR picks (``h_base``/``init_h``).
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch


def split_fragments(sizes: Sequence[int], count: int) -> List[List[Tuple[int, int, int]]]:
    """The concatenation of tensors of ``sizes`` elements cut into ``count`` runs of equal length (up to one
    element); each run as pieces ``(tensor index, start, end)``: a fragment may end inside a tensor, so a
    model of a few large tensors (or DeepSpeed's one flat partition) still splits evenly."""
    total = sum(sizes)
    edges = [total * k // count for k in range(count + 1)]
    runs: List[List[Tuple[int, int, int]]] = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        pieces, offset = [], 0
        for i, n in enumerate(sizes):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                pieces.append((i, a - offset, b - offset))
            offset += n
        runs.append(pieces)
    return runs


def run_views(tensors: Sequence[torch.Tensor], pieces: Sequence[Tuple[int, int, int]]) -> List[torch.Tensor]:
    """The pieces ``(tensor index, start, end)`` of a run of ``tensors`` as flat views that share their storage
    (writes land in the tensors)."""
    return [tensors[i].detach().view(-1)[a:b] for i, a, b in pieces]


def split_views(tensors: Sequence[torch.Tensor], count: int, k: int) -> List[torch.Tensor]:
    """Run ``k`` of ``count`` equal runs of the concatenation of ``tensors`` (:func:`split_fragments`), as views."""
    return run_views(tensors, split_fragments([t.numel() for t in tensors], count)[k])


def send_points(period: int, count: int) -> Dict[int, List[int]]:
    """Step of the round (1..period) -> fragments sent after it; the last fragment at ``period``."""
    points: Dict[int, List[int]] = {}
    for k in range(count):
        points.setdefault(max(1, math.ceil(period * (k + 1) / count)), []).append(k)
    return points
