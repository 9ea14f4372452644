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

Tuning: tau should cover the sync's transfer time in steps of compute
(``commhooks plan`` gives both); tau 1-5 with F 1-4 is the paper's range.
Keep ``tau`` below the shortest period QSR picks (``h_base``/``init_h``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..comm import Comm, Work
from .outer import OuterSync


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


@dataclasses.dataclass
class InFlight:
    """One fragment's sync between send and apply."""

    sent_at: int
    apply_at: int
    sent_from: Optional[torch.Tensor]  # the fragment's weights when it was sent (flat fp32; None: blocking)
    work: Work  # wait() gives (mean pseudo-gradient, mean proof), once waited kept
    scale: float = 1.0  # outer_normalize="lr_sum": the inner lr summed over the round it closes


class StreamedSyncs:
    """The fragments' outer states and their syncs in flight (schedule decisions stay with the caller)."""

    def __init__(self, sizes: Sequence[int], count: int, make_outer, merge: str = "progress", alpha: float = 1.0):
        self.fragments = split_fragments(sizes, count)
        self.outers: List[OuterSync] = [make_outer() for _ in self.fragments]
        self.merge, self.alpha = merge, alpha
        self.in_flight: Dict[int, InFlight] = {}

    def tensors(self, k: int, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Fragment ``k`` of ``tensors``: flat views that share their storage (writes land in the tensors)."""
        if len(self.fragments) == 1:
            return list(tensors)
        return run_views(tensors, self.fragments[k])

    @property
    def anchored(self) -> bool:
        return all(o.anchor is not None for o in self.outers)

    def take_anchor(self, comm: Comm, tensors: Sequence[torch.Tensor], group=None) -> None:
        for k, outer in enumerate(self.outers):
            outer.take_anchor(comm, self.tensors(k, tensors), group=group)

    def send(self, k: int, comm: Comm, tensors: Sequence[torch.Tensor], proof: torch.Tensor, step: int,
             apply_at: int, group=None, tag: str = "sync", seed: Optional[int] = None, scale: float = 1.0) -> None:
        """Start fragment ``k``'s sync (none of ``k`` may be in flight)."""
        assert k not in self.in_flight, f"fragment {k} is already in flight"
        work, sent_from = self.outers[k].send(comm, self.tensors(k, tensors), proof, group=group,
                                              tag=tag if len(self.outers) == 1 else f"{tag}-f{k}",
                                              seed=None if seed is None else seed * 64 + k)
        self.in_flight[k] = InFlight(step, apply_at, sent_from, work, scale)

    def due(self, step: int) -> List[int]:
        """Fragments whose sync applies at or before ``step`` (in fragment order)."""
        return sorted(k for k, f in self.in_flight.items() if f.apply_at <= step)

    def apply(self, k: int, tensors: Sequence[torch.Tensor], step: int) -> Tuple[torch.Tensor, int]:
        """Wait for fragment ``k``'s sync and apply it at optimizer ``step``; returns (mean proof, step it was
        sent at).  Landing at the step it was sent (a flush right after), nothing moved: the anchor, as for a
        blocking sync."""
        flight = self.in_flight.pop(k)
        mean, proofs = flight.work.wait()
        sent_from = flight.sent_from if step > flight.sent_at else None  # (None too when not kept: blocking)
        self.outers[k].apply(mean, self.tensors(k, tensors), sent_from, self.merge, self.alpha, flight.scale)
        return proofs, flight.sent_at

    def anchors(self) -> List[Tuple[str, torch.Tensor]]:
        return [(f"anchor{k}", o.anchor) for k, o in enumerate(self.outers)]

    def state_dict(self) -> dict:
        """Outer states, and the syncs in flight with their results (waited for: they are in the network).
        Collective in effect: every rank must call it at the same step (checkpoints are), or the ranks'
        later collectives pair up differently."""
        flights = {}
        for k, f in self.in_flight.items():
            mean, proofs = f.work.wait()
            flights[k] = {"sent_at": f.sent_at, "apply_at": f.apply_at, "scale": f.scale,
                          "sent_from": None if f.sent_from is None else f.sent_from.clone(),
                          "mean": mean.clone(), "proofs": proofs.clone()}
        return {"outers": [o.state_dict() for o in self.outers], "in_flight": flights}

    def load_state_dict(self, state: dict) -> None:
        if "outers" not in state:  # saved before fragments existed: one outer state
            state = {"outers": [state], "in_flight": {}}
        if len(state["outers"]) != len(self.outers):
            raise ValueError(f"the checkpoint holds {len(state['outers'])} fragments' outer state, this state has "
                             f"{len(self.outers)} (qsr.fragments changed?)")
        for k, (outer, saved) in enumerate(zip(self.outers, state["outers"])):
            want = sum(b - a for _, a, b in self.fragments[k])
            anchor = saved.get("anchor")
            if anchor is not None and anchor.numel() != want:
                raise ValueError(f"the checkpoint's anchor of fragment {k} has {anchor.numel()} elements, this rank "
                                 f"syncs {want} (the parameters, qsr.hierarchical or the group size changed?)")
            outer.load_state_dict(saved)
        self.in_flight = {int(k): InFlight(int(f["sent_at"]), int(f["apply_at"]),
                                           None if f["sent_from"] is None else f["sent_from"].clone(),
                                           Work(lambda r=(f["mean"].clone(), f["proofs"].clone()): r),
                                           float(f.get("scale", 1.0)))
                          for k, f in state["in_flight"].items()}
