"""A QSR sync, in the order it happens: the driver (:class:`SyncDriver`) runs the events of a step (the
:class:`~.state.Round` says which) on each fragment's state (:class:`FragmentSync`); the payload family
(:mod:`~commhooks.payload`) packs and averages the pseudo-gradients.

**A plain sync** averages the weights (parameters, BatchNorm buffers, with ``average_optimizer_state`` the optimizer
moments), one flat call per dtype with the step proof riding along: QSR's default.

**An outer step** (DiLoCo, arXiv 2311.08105; torchft's ``local_sgd.DiLoCo``).  Each rank keeps the weights of the
last sync, the *anchor* ``theta``, and sends its pseudo-gradient ``delta_i = theta - theta_i`` through the payload
codec (``error_feedback``: plus what the codec lost last time); the mean steps the anchor::

    d = mean_i delta_i;  m = mu * m + d;  step = d + mu * m (Nesterov) or m;  theta = theta - outer_lr * step

``outer_lr = 1, mu = 0`` is plain averaging.  DiLoCo's lr 0.7 / Nesterov 0.9 suits periods of tens to hundreds of
steps; at QSR's short periods at peak lr (h_base 2-8) momentum amplifies small pseudo-gradients, and lr 1 / momentum
0 with a compressed payload is safer.  ``outer_optimizer=`` (any ``torch.optim`` optimizer, as in torchft) is built
over the anchor and handed the mean as its ``.grad``; ``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)`` takes
the built-in's steps.  ``outer_normalize="lr_sum"``: the momentum sees ``d`` per unit of inner lr summed over the
round, the step is scaled back.

**Overlap** (``overlap_steps`` = tau; Streaming DiLoCo, arXiv 2501.18512): a sync sent after step ``s`` lands after
``s + tau``, the weights having moved on by ``p_i``; then ``theta_i = anchor + alpha * p_i``
(``overlap_merge="progress"``) or ``alpha * theta_i + (1 - alpha) * anchor`` (``"mix"``, the paper's, and torchft's
``fragment_update_alpha``, which mixes at a blocking sync too); ``alpha = 0`` discards the local side.
``overlap_schedule="send-before"`` sends each sync ``tau`` steps before its point and lands it on the point
(torchft's timeline since 2025-07) instead of sending on the point and landing ``tau`` later.  The ranks then differ by their progress, so ``check_every`` compares
the anchors.  **Fragments**: F equal runs of the parameters, each with its own anchor, momentum and residual, synced
at staggered steps (element-wise: together they equal one sync of the whole). Tuning: tau should cover a sync's
transfer in steps (``commhooks plan``); tau 1-5, F 1-4 is the paper's range; keep tau below ``h_base``.
**Hierarchical**: each rank sends its ``1/g`` part across groups, and the group's ranks share their parts after each
landing (``share-part``); buffers take the world mean.

Memory per fragment (fp32, its size; :func:`~.saved.fragment_memory`): anchor, momentum, residual, the weights a
sync left from until it lands, the send buffer, the mean until it lands; buffers are reused.  A checkpoint taken
while syncs are in flight waits for their results and saves them: resume is exact.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...comm import Comm, Work
from ...comm.base import flatten
from ...settings import ConfigError
from ..contract.checks import anywhere, same_everywhere
from ...phases import PhaseClock
from ...payload import Codec, OwnerFeedback, flat_into, reused, start_change_mean, write_flat
from .plan import SyncPlan, split_fragments

Tensors = List[torch.Tensor]
log = logging.getLogger("commhooks")  # DEBUG: one line per fragment sent and landed, to read against the timeline


@dataclasses.dataclass
class InFlight:
    """A fragment's sync between send and land."""

    sent_at: int
    apply_at: int
    sent_from: Optional[torch.Tensor]  # the fragment's weights when it was sent (flat fp32; None: blocking)
    work: Work  # wait() gives (mean pseudo-gradient, mean proof), once waited kept
    scale: float = 1.0  # outer_normalize="lr_sum": the inner lr summed over the round it closes
    sent_time: float = 0.0  # time.perf_counter() when it left (the phase clock's flight)


class SyncDriver:
    """Runs the events of a step on this rank's tensors, as the :class:`~.plan.SyncPlan` says (a plain mean, or
    an outer step per fragment).

    ``ctx``: the state's :class:`~commhooks.algorithms.contract.SyncContext` (the comm, the step, proofs, the
    failure context, the refresh of new parameters).  ``params`` / ``buffers`` / ``moments``: what a sync
    covers, read at each call (parameters added later join a plain mean).  ``across`` / ``replica``: the groups,
    set when the state starts (``across=None``: the world)."""

    def __init__(self, ctx, plan: SyncPlan, params, buffers, moments, config, make_optimizer=None):
        self.ctx, self.plan = ctx, plan
        self.covered, self.buffers, self.moments = params, buffers, moments
        self.merge, self.alpha = config.overlap_merge, config.overlap_alpha
        self.across = self.replica = None
        self.cuts: Dict[tuple, list] = {}  # (sizes, count) -> the runs (split_fragments), cut once
        c = config
        self.fragments = [FragmentSync(c.outer_lr, c.outer_momentum, c.outer_nesterov, c.codec, c.payload_block,
                                       c.error_feedback, keep_sent_from=c.overlap_steps > 0,
                                       make_optimizer=make_optimizer, feedback_decay=c.error_feedback_decay,
                                       phases=ctx.phases)
                          for _ in range(c.fragments if plan.outer_step else 0)]

    # ------------------------------------------------------------ what a sync covers
    def params(self) -> Tensors:
        """The parameters a sync covers (those added later join a plain mean)."""
        return self.covered.tensors

    def pieces(self, tensors: Sequence[torch.Tensor], count: int, k: int) -> Tensors:
        """Run ``k`` of ``count`` equal runs of the concatenation of ``tensors`` (a run may end inside a tensor), as
        flat views that share their storage: a rank's part, a fragment.  The cut is made once per sizes."""
        if count == 1:
            return list(tensors)
        key = (tuple(map(torch.numel, tensors)), count)
        if key not in self.cuts:
            self.cuts[key] = split_fragments(key[0], count)
        out = []
        for i, a, b in self.cuts[key][k]:
            out.append(tensors[i].detach().view(-1)[a:b])
        return out

    @property
    def within(self):
        """The replica group when a sync spans one rank of each (``across``): the step proof counts its NaN/Inf
        ranks, so that sync's sum counts the world's (:meth:`~commhooks.algorithms.contract.SyncContext.proof`)."""
        return self.replica if self.across is not None else None

    def sent(self) -> Tensors:
        """The parameters this rank sends across groups: its part (hierarchical), else all of them."""
        plan, params = self.plan, self.covered.tensors
        return self.pieces(params, len(plan.members), plan.member) if plan.hierarchical else params

    def named_extras(self) -> List[Tuple[str, torch.Tensor]]:
        return ([(f"buffer{i}", b) for i, b in enumerate(self.buffers())]
                + [(f"moment{i}", m) for i, m in enumerate(self.moments())])

    def identical_named(self, named_params) -> List[Tuple[str, torch.Tensor]]:
        """What a complete sync makes identical; streamed rounds keep each rank's progress: the anchors agree."""
        if not self.plan.streaming:
            return list(named_params) + self.named_extras()
        return [(f"anchor{k}", f.anchor) for k, f in enumerate(self.fragments)] + self.named_extras()

    def share(self, k: Optional[int] = None) -> None:
        """Hierarchical: every member broadcasts its freshly synced part (or fragment ``k`` of it) to the rest of
        the replica group, which is then identical.  Nothing otherwise."""
        if not self.plan.hierarchical:
            return
        params, members = self.covered.tensors, self.plan.members
        for m, src in enumerate(members):
            part = self.pieces(params, len(members), m)
            if k is not None:
                part = self.pieces(part, len(self.fragments), k)
            self.ctx.comm.broadcast(part, src=src, group=self.replica, tag="share-part")

    @property
    def in_flight(self) -> Dict[int, int]:
        """Fragment -> the step its sync in flight lands at (read after a checkpoint restored them)."""
        return {k: f.flight.apply_at for k, f in enumerate(self.fragments) if f.flight is not None}

    @property
    def anchored(self) -> bool:
        return all(f.anchor is not None for f in self.fragments)

    # ------------------------------------------------------------ the events, in the order a sync runs them
    def take_anchor(self) -> None:
        """First step of an outer step: every rank's anchor is its own copy of the weights, which every rank
        starts from equal (:func:`~commhooks.algorithms.contract.parameters.start_equal`), checked by a
        32-byte fingerprint; should they differ all the same (changed on some ranks since), the anchor is
        their mean.  An engine's shard is compared with its counterparts in the other groups (the answer
        then agreed by the world, 4 bytes)."""
        ctx, sent = self.ctx, self.sent()
        with ctx.failures():
            same = same_everywhere(ctx.comm, self.params(), group=self.across if self.plan.engine_sharded else None)
            if self.plan.engine_sharded:  # every rank decides alike (an engine's refresh below is collective)
                same = not anywhere(ctx.comm, not same, tag="anchor")
            for k, f in enumerate(self.fragments):
                f.take_anchor(ctx.comm, self.pieces(sent, len(self.fragments), k), group=self.across, averaged=not same)
            if not same:
                self.share()
        if not same:
            ctx.changed()

    def forget_own(self) -> None:
        """After a copy of another replica's state: its error-feedback residuals were that replica's own."""
        for f in self.fragments:
            f.residual, f.owner_feedback = None, OwnerFeedback()

    def close(self) -> None:
        """The round closes: parameters unfrozen or added to an optimizer since join a plain mean (an outer
        step, whose anchor covers the first step's parameters, refuses them)."""
        if self.ctx.refresh() and self.plan.outer_step:
            raise ConfigError("QSR with outer_lr / outer_momentum / payload / overlap_steps / fragments: parameters "
                              "added or unfrozen during training are not supported (the anchor covers the "
                              "parameters of the first step)")

    def send(self, k: int, apply_at: int, scale: float = 1.0) -> None:
        """Fragment ``k``'s sync leaves.  A plain mean lands at once (parameters with the moments, and the buffers
        where the world is the group; then the parts shared in the replica group)."""
        ctx = self.ctx
        log.debug("%s step %d: fragment %d sent, lands after step %d", ctx.name, ctx.step, k, apply_at)
        if not self.plan.outer_step:
            if not self.plan.sharded:
                ctx.average(self.params() + self.buffers() + self.moments(), tag="sync")
            else:
                ctx.average(self.sent() + self.moments(), group=self.across, tag="sync", within=self.within)
                with ctx.failures(), ctx.phases.phase("exchange"):
                    self.share()
            return
        with ctx.failures():
            tag = "sync" if len(self.fragments) == 1 else f"sync-f{k}"
            self.fragments[k].send(ctx.comm, self.pieces(self.sent(), len(self.fragments), k), ctx.proof(self.within),
                                   ctx.step, apply_at, group=self.across, tag=tag,
                                   seed=ctx.rounding_seed() * 64 + k, scale=scale)

    def land(self, k: int, mix: bool = True) -> None:
        """Fragment ``k``'s sync lands: the outer step, the parts shared, the proofs of the step it left at.
        ``mix=False``: the run's last (or a forced) sync, whose weights are the synced ones on every rank."""
        ctx = self.ctx
        if not self.plan.outer_step:
            log.debug("%s step %d: fragment %d landed, sent after step %d", ctx.name, ctx.step, k, ctx.step)
            return
        with ctx.failures():
            proofs, sent_at = self.fragments[k].land(self.pieces(self.sent(), len(self.fragments), k), ctx.step,
                                                     self.merge if mix else "progress", self.alpha)
            with ctx.phases.phase("exchange"):  # (the parts shared inside the replica group)
                self.share(k)
        log.debug("%s step %d: fragment %d landed, sent after step %d", ctx.name, ctx.step, k, sent_at)
        ctx.check(proofs, self.across, "sync", step=sent_at)
        ctx.changed()

    def end(self) -> None:
        """The round's buffers (the world mean: they differ inside a replica group) and moments (the parameters'
        group), where the sync itself did not carry them."""
        buffers, moments = self.buffers(), self.moments()
        if buffers and (self.plan.outer_step or self.plan.sharded):
            self.ctx.average(buffers, tag="sync-buffers")
        if moments and self.plan.outer_step:
            self.ctx.average(moments, group=self.across, tag="sync-moments", within=self.within)


class FragmentSync:
    """One fragment's outer state: anchor, outer momentum (or the user's outer optimizer), error-feedback
    residual, reused buffers; and its sync in flight."""

    def __init__(self, lr: float, momentum: float, nesterov: bool, codec, block: int, error_feedback: bool,
                 keep_sent_from: bool = True, make_optimizer=None, feedback_decay: float = 1.0, phases=None):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.codec = Codec.of(codec, block)  # a Codec, or a codec's name with its block size
        self.error_feedback = error_feedback
        self.feedback_decay = feedback_decay  # the residual's weight in the next sync (SparseLoCo's beta)
        self.keep_sent_from = keep_sent_from  # overlapped syncs merge the progress made since: keep the weights
        self.anchor: Optional[torch.Tensor] = None
        self.buffer: Optional[torch.Tensor] = None  # outer momentum
        self.residual: Optional[torch.Tensor] = None  # error feedback
        self.owner_feedback = OwnerFeedback()  # error feedback of the two-step exchange's second encoding
        self.buffers: Dict[str, torch.Tensor] = {}  # sync buffers, reused at every sync
        self.make_optimizer = make_optimizer  # params -> a torch.optim optimizer taking the outer step (None: built-in)
        self.optimizer: Optional[torch.optim.Optimizer] = None  # over [self.anchor], built at its first step
        self.optimizer_state: Optional[dict] = None  # loaded before the optimizer exists
        self.flight: Optional[InFlight] = None
        self.phases = phases if phases is not None else PhaseClock()  # the state's clock (a bare one: its own)

    def take_anchor(self, comm: Comm, tensors: Sequence[torch.Tensor], group=None, averaged: bool = True) -> None:
        """The anchor: the group's mean of ``tensors`` (which every rank then takes as its weights too); with
        ``averaged=False`` (every rank holds the same ``tensors``) a copy of them."""
        self.anchor = flatten([t.detach() for t in tensors]).float().clone()
        if averaged:
            comm.allreduce([self.anchor], op="mean", group=group, tag="anchor")
            write_flat(tensors, self.anchor)

    @torch.no_grad()
    def send(self, comm: Comm, tensors: Sequence[torch.Tensor], proof: torch.Tensor, step: int = 0,
             apply_at: int = 0, group=None, tag: str = "sync", seed: Optional[int] = None, scale: float = 1.0) -> None:
        """Start averaging this rank's pseudo-gradient; it lands at :meth:`land`.  The weights it left from are
        kept (``keep_sent_from``) for the progress made while it is in flight."""
        assert self.flight is None, "this fragment's sync is already in flight"
        with self.phases.phase("encode"):  # the change since the anchor, the codec, and the collective started
            self._send(comm, tensors, proof, step, apply_at, group, tag, seed, scale)

    def _send(self, comm, tensors, proof, step, apply_at, group, tag, seed, scale) -> None:
        n, device = sum(map(torch.numel, tensors)), tensors[0].device
        self._to(device)
        kept = reused(self.buffers, "sent_from", n, device) if self.keep_sent_from else None
        ef = self.error_feedback
        work, lost = start_change_mean(comm, tensors, self.anchor, self.codec, proof, self.buffers, group=group,
                                       tag=tag, seed=seed, error_feedback=ef, residual=self.residual if ef else None,
                                       residual_decay=self.feedback_decay,
                                       feedback=self.owner_feedback if ef else None, sent_from=kept)
        if lost is not None:
            self.residual = lost
        self.flight = InFlight(step, apply_at, kept, work, scale, time.perf_counter())

    @torch.no_grad()
    def land(self, tensors: Sequence[torch.Tensor], step: int, merge: str = "progress",
             alpha: float = 1.0) -> Tuple[torch.Tensor, int]:
        """Wait for the sync and apply it at optimizer ``step``: the outer step, then the weights; returns (mean
        proof, step it was sent at).  Landing at the step it was sent (a blocking sync), the weights become
        the new anchor (``mix``: ``alpha * local + (1 - alpha) * anchor``, as torchft mixes at every sync);
        otherwise ``merge`` keeps ``alpha`` of the progress since (``mix``: ``alpha * local + (1 - alpha) *
        anchor``)."""
        flight, self.flight = self.flight, None
        waiting = time.perf_counter()
        with self.phases.phase("exchange"):  # the wait: all of a blocking sync's, an overlapped one's exposed part
            mean, proofs = flight.work.wait()
        if step > flight.sent_at:  # overlapped: in flight while the rank trained on, then this wait
            self.phases.flight(waiting - flight.sent_time, time.perf_counter() - waiting)
        with self.phases.phase("land"):
            return self._land(flight, mean, proofs, tensors, step, merge, alpha)

    def _land(self, flight, mean, proofs, tensors, step, merge, alpha) -> Tuple[torch.Tensor, int]:
        sent_from = flight.sent_from if step > flight.sent_at else None
        device = tensors[0].device
        self._to(device)  # after a load onto the CPU
        mean = mean.to(device)
        scale = flight.scale
        if scale != 1.0:
            mean = mean / scale
        if self.make_optimizer is not None:
            self._optimizer_step(mean, scale)
        else:
            update = mean
            if self.momentum:
                self.buffer = mean.clone() if self.buffer is None else self.buffer.mul_(self.momentum).add_(mean)
                update = mean + self.momentum * self.buffer if self.nesterov else self.buffer
            self.anchor -= (self.lr * scale) * update if scale != 1.0 else self.lr * update
        if sent_from is None and merge == "mix" and alpha != 0.0:  # a blocking sync that mixes (torchft's alpha)
            now = flat_into(reused(self.buffers, "now", self.anchor.numel(), device), tensors)
            write_flat(tensors, alpha * now + (1.0 - alpha) * self.anchor)
        elif sent_from is None or alpha == 0.0:
            write_flat(tensors, self.anchor)
        else:
            now = flat_into(reused(self.buffers, "now", sent_from.numel(), device), tensors)
            write_flat(tensors, self.anchor + alpha * (now - sent_from.to(device)) if merge == "progress" else (
                alpha * now + (1.0 - alpha) * self.anchor))
        return proofs, flight.sent_at

    def sync(self, comm: Comm, tensors: Sequence[torch.Tensor], proof: torch.Tensor, group=None,
             tag: str = "sync", seed: Optional[int] = None) -> torch.Tensor:
        """One blocking outer step; ``tensors`` become the new anchor.  Returns the mean of the ranks' proofs."""
        self.send(comm, tensors, proof, group=group, tag=tag, seed=seed)
        return self.land(tensors, 0)[0]

    def _optimizer_step(self, mean: torch.Tensor, scale: float) -> None:
        """The user's outer optimizer steps the anchor with ``mean`` as its gradient (its lr times ``scale``)."""
        if self.optimizer is None or self.optimizer.param_groups[0]["params"][0] is not self.anchor:
            saved = self.optimizer.state_dict() if self.optimizer is not None else self.optimizer_state
            self.optimizer = self.make_optimizer([self.anchor])  # (again after the anchor moved or was loaded)
            if saved is not None:
                self.optimizer.load_state_dict(saved)
            self.optimizer_state = None
        self.anchor.grad = mean
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * scale
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.anchor.grad = None

    def _to(self, device) -> None:
        """After a load onto the CPU: the state goes where the parameters are."""
        for key in ("anchor", "buffer", "residual"):
            value = getattr(self, key)
            if value is not None and value.device != device:
                setattr(self, key, value.to(device))
        owned = self.owner_feedback.value
        if owned is not None and owned.device != device:
            self.owner_feedback.value = owned.to(device)
