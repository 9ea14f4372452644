"""One sync pipeline: what a sync covers, when each piece travels, how it travels and lands.

A local method's sync answers three questions.  Each has one object here, built
once at set-up; the algorithm (:mod:`.qsr`) only decides when a round ends::

    SyncCover       what: the parameters this rank sends (its part of them with
                    ``hierarchical``), floating buffers, optimizer moments, and
                    the group each is averaged over
    RoundSchedule   when: which fragment is sent after which step of a round,
                    and the step it lands at
    MeanSync        how, plain: the mean of the weights, blocking (QSR's default)
    OuterSteps      how, DiLoCo: an outer step per fragment on the averaged
                    pseudo-gradient, sent through a payload codec, maybe landing
                    ``overlap_steps`` later (:mod:`.outer`, :mod:`.payload`)

Both transports have one interface (``send``, ``due``, ``land``,
``finish_round``, ``take_anchor``), so the algorithm's ``after_step`` and
``sync`` branch on no feature.

**Timeline** of one QSR round with ``fragments=3, overlap_steps=1`` and a
period ``H=6`` (steps of the round; ``sN``: fragment N sent after that step,
``lN``: it lands after that step, before the next optimizer step)::

    step of round   1    2    3    4    5    6  | 1 (next round)
    sent                 s0        s1        s2 |
    landed                    l0        l1      | l2
    optimizer step  k+1  k+2  k+3  k+4  k+5  k+6  k+7

Fragment ``k`` of ``F`` is sent after step ``ceil(H (k + 1) / F)`` of the
round (:func:`~.streaming.send_points`) and lands ``overlap_steps`` steps
later, never after ``total_steps`` (the last round of a known run ends with
every fragment sent and landed at once: the ranks end identical).  A
fragment whose previous sync is still in flight lands before it is sent
again.  With ``fragments=1, overlap_steps=0`` this is one blocking sync at
the round's end, the plain case.  The logger ``commhooks`` at DEBUG prints one line per fragment sent and
landed ("QSR step 2: fragment 0 sent, lands after step 3"; a test reads this
table and compares it with those lines); syncs sent at step ``s`` carry
proofs of step ``s`` and are checked when they land.

**Hierarchical** (replica groups of k ranks): the cover's parameters are
this rank's 1/k of the replica's, averaged over the same part of the other
groups (``across``); after each landing the group's ranks share their parts
over the node's links (tag ``share-part``).  Buffers differ inside a replica
group and take the world mean; moments follow the parameters' group.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..comm import Comm, Work
from ..config import ConfigError
from .alignment import STEP_PROOF_BYTES
from .consistency import same_everywhere
from .outer import OuterSync
from .streaming import run_views, send_points, split_fragments, split_views

Tensors = List[torch.Tensor]
log = logging.getLogger("commhooks")  # DEBUG: one line per fragment sent and landed, to read against the timeline


def _trace(host, event: str, k: int, at: int) -> None:
    log.debug("%s step %d: fragment %d %s %d", host.display_name, host.step, k, event, at)


class SyncCover:
    """What a sync covers, declared once: parameters (live: parameters added later join a plain mean),
    floating buffers, optimizer moments, and the groups they are averaged over.

    ``members``: the ranks of this rank's replica group; ``hierarchical``: each sends only its part of the
    parameters (``member`` of ``len(members)`` equal runs).  ``across`` / ``replica``: the groups, set when the
    state starts (``across=None``: the world)."""

    def __init__(self, params: Callable[[], Tensors], buffers: Callable[[], Tensors],
                 moments: Callable[[], Tensors], members: Sequence[int], rank: int, hierarchical: bool):
        self.params, self.buffers, self.moments = params, buffers, moments
        self.members, self.member = tuple(members), list(members).index(rank)
        self.hierarchical = hierarchical
        self.across = None  # the group parameters are averaged over (the same shard/part of every replica)
        self.replica = None  # this rank's replica group (the parts are shared there)

    def part(self, member: int, tensors: Sequence[torch.Tensor]) -> Tensors:
        """Member ``member``'s part of ``tensors`` (equal runs of their concatenation), as flat views."""
        return split_views(tensors, len(self.members), member)

    def sent(self) -> Tensors:
        """The parameters this rank sends across groups: its part (hierarchical), else all of them."""
        params = self.params()
        return self.part(self.member, params) if self.hierarchical else params

    def named(self, named_params: Sequence[Tuple[str, torch.Tensor]]) -> List[Tuple[str, torch.Tensor]]:
        """Everything a complete sync makes identical, by name: parameters, buffers, moments."""
        return list(named_params) + self.named_extras()

    def named_extras(self) -> List[Tuple[str, torch.Tensor]]:
        return ([(f"buffer{i}", b) for i, b in enumerate(self.buffers())]
                + [(f"moment{i}", m) for i, m in enumerate(self.moments())])

    def share(self, comm: Comm, fragment: Optional[int] = None, fragments: int = 1) -> None:
        """Hierarchical: every member broadcasts its freshly synced part (or fragment ``fragment`` of it) to the
        rest of the replica group; afterwards the group is identical.  Nothing otherwise."""
        if not self.hierarchical:
            return
        params = self.params()
        for m, src in enumerate(self.members):
            part = self.part(m, params)
            if fragment is not None and fragments > 1:
                part = split_views(part, fragments, fragment)
            comm.broadcast(part, src=src, group=self.replica, tag="share-part")


class RoundSchedule:
    """When each fragment is sent and lands (the timeline in the module docstring), for a config with
    ``fragments``, ``overlap_steps``, ``total_steps`` and ``streaming``; the state and its traffic declaration
    (:mod:`.qsr_traffic`) both follow it.  ``config`` is read at each call: an integration may fill
    ``total_steps`` after the state is built (the Trainer with DeepSpeed does)."""

    def __init__(self, config):
        self.config = config

    @property
    def fragments(self) -> int:
        return self.config.fragments

    @property
    def streaming(self) -> bool:
        """Rounds may end with the ranks apart (overlap or fragments)."""
        return self.config.streaming

    def sends(self, since_sync: int, period: int) -> List[int]:
        """The fragments sent after step ``since_sync`` (1..period) of a round of ``period`` steps."""
        return send_points(period, self.fragments).get(since_sync, [])

    def ends_run(self, step: int) -> bool:
        """At optimizer ``step`` the run's last round closes: streamed syncs end with one blocking sync of all."""
        total = self.config.total_steps
        return self.streaming and total is not None and step >= total

    def lands_at(self, step: int, blocking: bool) -> int:
        """The step a sync sent after ``step`` lands at: ``overlap_steps`` later, never past ``total_steps``."""
        at = step if blocking else step + self.config.overlap_steps
        total = self.config.total_steps
        return at if total is None else min(at, max(step, total))


class MeanSync:
    """Plain averaging: the weights' mean over the cover's groups, sent and landed at once, one flat call per
    dtype with the step proof riding along.  Parameters added during training join it."""

    streaming = False
    anchored = True
    fragments = 1

    def __init__(self, host, cover: SyncCover):
        self.host, self.cover = host, cover
        self.in_flight: Dict[int, object] = {}

    def take_anchor(self) -> None:
        """Nothing: plain averaging keeps no anchor."""

    def check_new_parameters(self, names: List[str]) -> None:
        """New parameters join the next mean."""

    def due(self, step: int) -> List[int]:
        return []

    def send(self, k: int, apply_at: int, scale: float = 1.0) -> None:
        """The parameters' mean (with the moments; with the buffers too when the world is the group), then the
        parts shared inside the replica group."""
        c = self.cover
        _trace(self.host, "sent, lands after step", k, apply_at)
        if c.across is None:
            self.host.average(c.params() + c.buffers() + c.moments(), tag="sync")
        else:
            self.host.average(c.sent() + c.moments(), group=c.across, tag="sync")
            with self.host.collective_context():
                c.share(self.host.comm)

    def land(self, k: int) -> None:
        """Nothing left: :meth:`send` landed it."""
        _trace(self.host, "landed, sent after step", k, self.host.step)

    def finish_round(self) -> None:
        """Buffers a sharded mean left out: the world mean."""
        if self.cover.across is not None:
            buffers = self.cover.buffers()
            if buffers:
                self.host.average(buffers, tag="sync-buffers")

    def identical_named(self, named_params) -> List[Tuple[str, torch.Tensor]]:
        return self.cover.named(named_params)

    def memory(self, group_size: int) -> Dict[str, int]:
        return {}

    def state_dict(self) -> Optional[dict]:
        return None

    def load_state_dict(self, state: Optional[dict]) -> None:
        pass


@dataclasses.dataclass
class InFlight:
    """One fragment's sync between send and land."""

    sent_at: int
    apply_at: int
    sent_from: Optional[torch.Tensor]  # the fragment's weights when it was sent (flat fp32; None: blocking)
    work: Work  # wait() gives (mean pseudo-gradient, mean proof), once waited kept
    scale: float = 1.0  # outer_normalize="lr_sum": the inner lr summed over the round it closes


class StreamedSyncs:
    """The fragments' outer states (:class:`~.outer.OuterSync`) and their syncs in flight; no schedule."""

    def __init__(self, sizes: Sequence[int], count: int, make_outer, merge: str = "progress", alpha: float = 1.0):
        self.fragments = split_fragments(sizes, count)
        self.outers: List[OuterSync] = [make_outer() for _ in self.fragments]
        self.merge, self.alpha = merge, alpha
        self.in_flight: Dict[int, InFlight] = {}

    def tensors(self, k: int, tensors: Sequence[torch.Tensor]) -> Tensors:
        """Fragment ``k`` of ``tensors``: flat views that share their storage (writes land in the tensors)."""
        return list(tensors) if len(self.fragments) == 1 else run_views(tensors, self.fragments[k])

    @property
    def anchored(self) -> bool:
        return all(o.anchor is not None for o in self.outers)

    def take_anchor(self, comm: Comm, tensors: Sequence[torch.Tensor], group=None, averaged: bool = True) -> None:
        """Each fragment's anchor: the group's mean of ``tensors``, or (``averaged=False``: every rank holds the
        same already) this rank's own copy, with nothing sent."""
        for k, outer in enumerate(self.outers):
            outer.take_anchor(comm, self.tensors(k, tensors), group=group, averaged=averaged)

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


class OuterSteps:
    """DiLoCo outer steps: per fragment, the pseudo-gradient against the fragment's anchor is sent through the
    payload codec, averaged, and applied by the outer optimizer when it lands (:mod:`.outer`)."""

    def __init__(self, host, cover: SyncCover, make_outer: Callable[[], OuterSync], fragments: int,
                 merge: str, alpha: float, streaming: bool):
        self.host, self.cover, self.streaming = host, cover, streaming
        self.streams = StreamedSyncs([t.numel() for t in cover.sent()], fragments, make_outer, merge, alpha)

    @property
    def fragments(self) -> int:
        return len(self.streams.outers)

    @property
    def anchored(self) -> bool:
        return self.streams.anchored

    @property
    def in_flight(self) -> Dict[int, InFlight]:
        return self.streams.in_flight

    def check_new_parameters(self, names: List[str]) -> None:
        if names:
            raise ConfigError("QSR with outer_lr / outer_momentum / payload / overlap_steps / fragments: parameters "
                              "added or unfrozen during training are not supported (the anchor covers the "
                              "parameters of the first step)")

    def take_anchor(self) -> None:
        """First step: every rank's anchor is its own copy of the weights, which every rank starts from equal
        (the state's set-up broadcasts rank 0's where an engine left them apart:
        :meth:`~.base.AlgorithmState._start_equal`), checked by a 32-byte fingerprint comparison; should they
        differ all the same (weights changed on some ranks between the set-up and the first step), the anchor
        is their mean."""
        host = self.host
        with host.collective_context():
            if same_everywhere(host.comm, self.cover.params()):
                self.streams.take_anchor(host.comm, self.cover.sent(), averaged=False)
                return
            self.streams.take_anchor(host.comm, self.cover.sent(), group=self.cover.across)
            self.cover.share(host.comm)
        host.tensors_changed()

    def due(self, step: int) -> List[int]:
        return self.streams.due(step)

    def send(self, k: int, apply_at: int, scale: float = 1.0) -> None:
        host = self.host
        _trace(host, "sent, lands after step", k, apply_at)
        with host.collective_context():
            self.streams.send(k, host.comm, self.cover.sent(), host.step_proof(), host.step, apply_at,
                              group=self.cover.across, tag="sync", seed=host.rounding_seed(), scale=scale)

    def land(self, k: int) -> None:
        """Wait for fragment ``k``, step its anchor, share the parts, check the proofs of the step it left at."""
        host = self.host
        with host.collective_context():
            proofs, sent_at = self.streams.apply(k, self.cover.sent(), host.step)
            self.cover.share(host.comm, k, self.fragments)
        _trace(host, "landed, sent after step", k, sent_at)
        host.check_proof(proofs, self.cover.across, "sync", step=sent_at)
        host.tensors_changed()

    def finish_round(self) -> None:
        """Buffers (the world mean: they differ inside a replica group), then moments (the parameters' group)."""
        buffers, moments = self.cover.buffers(), self.cover.moments()
        if buffers:
            self.host.average(buffers, tag="sync-buffers")
        if moments:
            self.host.average(moments, group=self.cover.across, tag="sync-moments")

    def identical_named(self, named_params) -> List[Tuple[str, torch.Tensor]]:
        """Streamed rounds end with each rank's local progress on top: the anchors are what agree."""
        if not self.streaming:
            return self.cover.named(named_params)
        return self.streams.anchors() + self.cover.named_extras()

    def memory(self, group_size: int) -> Dict[str, int]:
        """Per fragment: anchor, outer momentum, residual, reused buffers; and, for a compressed payload in
        flight, the gathered payloads of the group (size x payload bytes) and the mean."""
        out: Dict[str, int] = {}
        for o in self.streams.outers:
            for kind, n in o.memory().items():
                out[kind] = out.get(kind, 0) + n
        codec = self.streams.outers[0].codec
        if codec.name != "fp32" and self.in_flight:
            numels = [sum(b - a for _, a, b in self.streams.fragments[k]) for k in self.in_flight]
            two_step = codec.exchange_for(group_size)
            held = (lambda n: two_step.received_bytes(n, STEP_PROOF_BYTES)) if two_step is not None else (
                lambda n: group_size * (STEP_PROOF_BYTES + codec.nbytes(n)))
            out["in_flight"] = sum(held(n) + 4 * n for n in numels)
        return out

    def state_dict(self) -> dict:
        return self.streams.state_dict()

    def load_state_dict(self, state: Optional[dict]) -> None:
        if state is None:
            raise ValueError("it holds no outer-step state (saved by a run with plain averaging?), and this run's "
                             "config takes outer steps (outer_lr / outer_momentum / payload / overlap_steps / "
                             "fragments): resume with the config it was saved with")
        self.streams.load_state_dict(state)
