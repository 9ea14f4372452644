"""Local SGD / local AdamW gated by the Quadratic Synchronisation Rule.

Gu, Lyu, Arora, Zhang, Huang, "A Quadratic Synchronization Rule for
Distributed Deep Learning", ICLR 2024 (arXiv 2310.14423).

Every rank runs its own optimizer on its own data; no gradient crosses the
network.  After ``H`` optimizer steps the ranks average their parameters
(one flat allreduce), and the next period is chosen from the learning rate
the next step will use::

    H = init_h                                            while step < warmup_steps
    H = max(1, min(total_steps - step,
                   max(h_base, floor((alpha / lr) ** power))))   otherwise

``power=2`` is QSR; 1 and 3 are the comparison rules of the paper; ``alpha=0``
is constant-period local SGD.  As the lr decays, H grows quadratically, so
communication thins out exactly when it matters least for accuracy (the paper
shows it even improves generalisation).

Paper settings: ViT-B / local AdamW, ``h_base=4, alpha=0.0175``, peak lr
0.008, cosine decay, 10k warm-up steps: syncs on ~10 % of the steps instead of
25 % for constant H=4, with higher top-1 accuracy.

Tuning advice:

* ``h_base`` bounds the drift at peak lr; 2-8 is the useful range.
* ``alpha`` sets where the rule takes over: ``(alpha/lr)**2 > h_base`` once
  ``lr < alpha / sqrt(h_base)``.  The paper's ViT setting puts that point at
  the peak lr (``alpha ~ peak_lr * sqrt(h_base)``); on MNIST-1D here (AdamW,
  peak lr 0.003, h_base 4) alpha 0.006 syncs on 11 % of the steps and 0.01
  on 4.7 %, both at DDP's accuracy.
* ``warmup_steps`` must cover the lr warm-up: a tiny warm-up lr would give a
  huge first period.
* Leave ``average_optimizer_state`` off (the paper's code averages parameters
  only); turn it on if local Adam moments drift apart on very skewed data.
* BatchNorm running statistics are averaged at each sync
  (``average_buffers``); integer buffers such as ``num_batches_tracked`` are
  left alone.

Plain tensor math over a :class:`~commhooks.comm.Comm`; the engines drive it
through the :class:`~commhooks.algorithms.base.AlgorithmState` contract.
"""

from __future__ import annotations

import warnings
from typing import ClassVar, Dict, List, Literal, Optional, Sequence, Tuple

import torch
from pydantic import Field
from typing_extensions import Annotated

from ..registry import register_algorithm
from .averaging import float_buffers, optimizer_moments
from ..comm import Group
from . import replicas
from ..config import ConfigError
from .base import AlgorithmState, user_stacklevel
from .outer import OuterSync
from .payload import PayloadFields
from .streaming import StreamedSyncs, send_points, split_views
from .rule import QuadraticRuleFields, rule_period


class QSRConfig(QuadraticRuleFields, PayloadFields):
    """Local SGD / local AdamW synchronised by the Quadratic Synchronisation Rule.

    After a sync, the next round lasts
    ``H = max(h_base, floor((alpha / lr) ** power))`` optimizer steps
    (``init_h`` while ``step < warmup_steps``; capped at the remaining steps when
    ``total_steps`` is known; at least 1).

    Tuning: ``h_base`` is the period at peak lr (the paper uses 4 for ViT-B
    and 2 for ResNet).  The rule exceeds ``h_base`` once
    ``lr < alpha / h_base ** (1 / power)``; the paper's ViT setting
    (alpha 0.0175, peak lr 0.008, h_base 4) puts that point at the peak, so
    the rule governs the whole decay: start from ``alpha ~ peak_lr *
    sqrt(h_base)`` and raise it to thin communication further.
    ``warmup_steps`` must cover the lr warm-up (a tiny warm-up lr would
    otherwise give a huge H).  ``alpha = 0`` gives constant ``H = h_base``.

    A sync can be a DiLoCo outer step on the pseudo-gradient (``outer_lr``,
    ``outer_momentum``) sent in fp32, bf16 or int8 (``payload``, with
    ``error_feedback``), overlapped with the next ``overlap_steps`` local
    steps and staggered in ``fragments``; see
    :mod:`commhooks.algorithms.outer`, :mod:`commhooks.algorithms.payload`
    and :mod:`commhooks.algorithms.streaming`.  On MNIST-1D the combination QSR
    periods + outer lr 0.7 / Nesterov 0.9 + int8 sends 1.3 % of DDP's bytes.

    ``hierarchical`` (replica groups of k ranks, e.g. the GPUs of a node
    sharing one network card): the ranks of a group hold the same weights,
    so each sends only its 1/k of them across nodes and the group shares the
    k parts over the node's own links afterwards: the node link carries one
    model's worth of payload per sync instead of k (an allgather payload,
    int8 or bf16, falls further: each part goes to one rank per group).  The
    result is the same sync (identical weights; int8 blocks restart at each
    part's start).  Turn it on whenever a node holds several ranks.
    """

    type: Literal["qsr"] = "qsr"
    schedule_keys: ClassVar[Dict[str, str]] = {"total_steps": "total", "warmup_steps": "warmup"}
    h_base: Annotated[int, Field(ge=1, description=(
        "period at peak lr and the rule's floor (paper: 4 for ViT-B, 2 for ResNet)"))] = 4
    init_h: Annotated[Optional[int], Field(ge=1, description="period while step < warmup_steps (null = h_base)")] = None
    warmup_steps: Annotated[int, Field(ge=0, description=(
        "steps of the lr warm-up: the rule starts after them (a tiny warm-up lr would give a huge period)"))] = 0
    average_optimizer_state: bool = Field(False, description=(
        "also average exp_avg, exp_avg_sq, momentum_buffer at each sync (off in the paper's code)"))
    average_buffers: bool = Field(True, description="average floating buffers (BatchNorm statistics) at each sync")
    group_size: Annotated[Optional[int], Field(ge=1, description=(
        "ranks per replica group: gradients are averaged inside a group every step (fast links), parameters "
        "across groups by the rule; 1 = every rank its own replica (plain local SGD); null = ranks per node"))] = 1
    outer_lr: Annotated[float, Field(gt=0.0, description=(
        "DiLoCo outer step: weights = anchor - outer_lr * (averaged pseudo-gradient, with momentum); 1 with "
        "outer_momentum 0 is plain averaging (DiLoCo: 0.7)"))] = 1.0
    outer_momentum: Annotated[float, Field(ge=0.0, lt=1.0, description=(
        "momentum of the outer step (DiLoCo: 0.9); 0 = none"))] = 0.0
    outer_nesterov: bool = Field(True, description="Nesterov momentum in the outer step (DiLoCo's choice)")
    outer_normalize: Literal["none", "lr_sum"] = Field("none", description=(
        "lr_sum: the outer momentum sees the pseudo-gradient divided by the inner lr summed over its round (a "
        "long late round and a short early one on one scale, as QSR's periods change), the step scaled back; "
        "none: DiLoCo's outer step"))
    error_feedback: bool = Field(False, description=(
        "add what the payload codec lost at a sync to the next sync's pseudo-gradient"))
    overlap_steps: Annotated[int, Field(ge=0, description=(
        "apply each sync this many local steps after sending it, training on meanwhile (Streaming DiLoCo's "
        "tau; 0 = blocking); keep it below the shortest period"))] = 0
    overlap_merge: Literal["progress", "mix"] = Field("progress", description=(
        "how an overlapped sync lands: progress = synced weights + overlap_alpha * the local steps made "
        "meanwhile; mix = overlap_alpha * local + (1 - overlap_alpha) * synced (the paper's mixing)"))
    overlap_alpha: Annotated[float, Field(ge=0.0, le=1.0, description=(
        "weight of the local side in overlap_merge (progress: 1 keeps every in-flight step; mix: paper 0.5; "
        "0 in either = torchft: discard the in-flight steps)"))] = 1.0
    fragments: Annotated[int, Field(ge=1, description=(
        "cut the parameters into this many equal runs whose syncs are staggered across the period (the "
        "link carries 1/fragments of the model at a time)"))] = 1
    hierarchical: bool = Field(False, description=(
        "with replica groups of k ranks: each rank syncs 1/k of the parameters with the same part of the "
        "other groups, then the group's ranks share their parts inside the node (k times less traffic "
        "across nodes; Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE for local SGD)"))

    @property
    def pseudo_gradient(self) -> bool:
        """True when a sync is an outer step on the pseudo-gradient (outer optimizer or compressed payload)."""
        return (self.outer_lr != 1.0 or self.outer_momentum != 0.0 or self.payload != "fp32"
                or self.overlap_steps > 0 or self.fragments > 1 or self.outer_normalize != "none")

    @property
    def warmup_h(self) -> int:
        """Period used while ``step < warmup_steps`` (``init_h``, default ``h_base``)."""
        return self.h_base if self.init_h is None else self.init_h


def qsr_period(step: int, lr: float, config: QSRConfig) -> int:
    """The synchronisation period for the round that starts at ``step``.

    ``step`` is the number of optimizer steps already done; ``lr`` is the
    learning rate of the round's first step.
    """
    if step < config.warmup_steps:
        return config.warmup_h
    return rule_period(step, lr, config, config.h_base)


class QSRState(AlgorithmState):
    """Hook state for QSR-gated local SGD.

    One line after building the DDP model and the optimizer::

        state = commhooks.ddp.register(ddp_model, optimizer, {"type": "qsr", "alpha": 0.0175, "h_base": 4})

    or by hand: ``state = commhooks.QSRState(optimizer, model=ddp_model, alpha=0.0175, h_base=4)`` and
    ``ddp_model.register_comm_hook(state, commhooks.qsr_hook)``.  ``model`` is
    optional: give it so BatchNorm buffers are averaged and DDP's
    ``broadcast_buffers`` is checked.  Keyword arguments are the fields of
    :class:`QSRConfig`; ``config=`` takes a config object, dict or JSON path.

    Steps are counted by the optimizer post-hook, so ``no_sync()`` gradient
    accumulation counts optimizer steps, not micro-batches.  The period of a
    round is chosen in the pre-hook of its first step, i.e. after your
    ``scheduler.step()`` has set the lr that step really uses.
    """

    @classmethod
    def groups_needed(cls, config, world_size, local_world_size):
        size = replicas.resolve_size(config.group_size, world_size, local_world_size)
        groups = replicas.contiguous_groups(size, world_size, "qsr.group_size")
        if config.hierarchical and size > 1:  # each rank's part meets the same part of the other groups
            groups = groups + replicas.across_groups(groups)
        return groups

    engine_data_parallel = True  # an engine may run its own data parallelism (and ZeRO) inside each replica group

    @property
    def runs_apart(self) -> bool:
        """Between syncs each replica group's model is its own (unless the world is one group)."""
        return len(self.replica_ranks) > 1

    @property
    def reduces_gradients(self) -> bool:
        """Only with replica groups of 2 or more, unless the engine averages inside them itself."""
        return self.replica.size > 1 and not self.engine.replica_data_parallel

    def setup(self) -> None:
        origin = " (ranks per node, LOCAL_WORLD_SIZE)" if self.config.group_size is None else ""
        size = replicas.resolve_size(self.config.group_size, self.comm.size, self.engine.local_world_size)
        self.replica_ranks = replicas.contiguous_groups(size, self.comm.size, "qsr.group_size", origin)
        self.since_sync = 0
        self.H: Optional[int] = None  # chosen at the first step of each round
        self._previous_lr: Optional[float] = None
        self._warned = set()  # warnings given once: "rising"
        c = self.config
        mine = self._mine()
        self.member = mine.index(self.comm.rank)  # this rank's part of the parameters (hierarchical)
        self.hierarchical = c.hierarchical and len(mine) > 1 and not self.engine.replica_data_parallel
        self._check_hierarchical()
        self.outer = StreamedSyncs(
            [t.numel() for t in self._sync_tensors()], c.fragments,
            lambda: OuterSync(c.outer_lr, c.outer_momentum, c.outer_nesterov, c.codec, c.payload_block,
                              c.error_feedback, keep_sent_from=c.overlap_steps > 0),
            c.overlap_merge, c.overlap_alpha) if c.pseudo_gradient else None
        self.streaming = c.overlap_steps > 0 or c.fragments > 1  # rounds that do not end with identical weights
        self._lr_sums = [0.0] * c.fragments
        self._complete_at: Optional[int] = None  # last step after which every rank held the same weights
        self._check_streaming()
        if self.engine.buffers_synced_each_forward and float_buffers(self.module):
            warnings.warn(
                "the DDP model re-broadcasts buffers from rank 0 on every forward "
                "(broadcast_buffers / forward_sync_buffers=True): that is traffic on every step "
                "and overrides the local buffers; build DDP with forward_sync_buffers=False "
                "(torch>=2.13) or broadcast_buffers=False, QSR averages buffers at each sync",
                stacklevel=user_stacklevel(),
            )

    def _check_hierarchical(self) -> None:
        """A part is a run of flat views of the parameters (ConfigError on every rank alike)."""
        if self.hierarchical:
            self._require_contiguous("qsr.hierarchical needs", "a rank's part", "hierarchical false")

    def _require_contiguous(self, what: str, piece: str, instead: str) -> None:
        """ConfigError naming the non-contiguous parameters: ``piece`` would be a view of them."""
        bent = [n for n, p in self.named_params if not p.is_contiguous()]
        if bent:
            raise ConfigError(f"{what} contiguous parameters ({piece} is a view of them); not contiguous: "
                              f"{bent[:4]} (e.g. channels_last): use {instead}")

    def _part(self, member: int, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Member ``member``'s part of ``tensors`` (equal runs of their concatenation): flat views that share
        their storage."""
        return split_views(tensors, len(self._mine()), member)

    def _mine(self) -> Tuple[int, ...]:
        """The ranks of this rank's replica group."""
        return self.replica_ranks[replicas.group_of(self.replica_ranks, self.comm.rank)]

    def _sync_tensors(self) -> List[torch.Tensor]:
        """What this rank syncs across groups: its part of the parameters (hierarchical), else all of them."""
        params = self._params()
        return self._part(self.member, params) if self.hierarchical else params

    def _share_parts(self, fragment: Optional[int] = None) -> None:
        """Hierarchical: every rank of the replica group broadcasts its freshly synced part (or fragment
        ``fragment`` of it) to the others, over the node's own links; afterwards the group is identical."""
        if not self.hierarchical:
            return
        params = self._params()
        mine = self._mine()
        with self.collective_context():
            for m, src in enumerate(mine):
                part = self._part(m, params)
                if fragment is not None and self.outer is not None and len(self.outer.outers) > 1:
                    part = split_views(part, len(self.outer.outers), fragment)
                self.comm.broadcast(part, src=src, group=self.replica, tag="share-part")

    def _check_streaming(self) -> None:
        """Local checks of overlap_steps / fragments against the tensors (ConfigError on every rank alike)."""
        c = self.config
        if c.fragments > 1:
            numel = sum(p.numel() for _, p in self.named_params)
            if c.fragments > numel:
                raise ConfigError(f"qsr.fragments must be <= the {numel} synced elements, got {c.fragments}")
            self._require_contiguous("qsr.fragments > 1 needs", "a fragment", "fragments 1")
        if c.overlap_steps >= c.h_base:
            warnings.warn(
                f"QSR: overlap_steps={c.overlap_steps} >= h_base={c.h_base}: at periods of {c.overlap_steps} steps or "
                "fewer a sync is still in flight when the next one is due, so it lands first (the rank waits for it) "
                f"and the overlap hides less than asked; use overlap_steps < h_base (e.g. {max(1, c.h_base // 2)})",
                stacklevel=user_stacklevel())

    def describe(self) -> dict:
        return {"replica_groups": self.replica_ranks}

    def start(self) -> None:
        mine = replicas.group_of(self.replica_ranks, self.comm.rank)
        self.shards = None  # the group of this rank's shard across replicas, when the engine shards
        if len(self.replica_ranks[mine]) == 1:  # every rank its own replica: no group to create
            self.replica = Group(f"replica{mine}", self.replica_ranks[mine])
            return
        groups = [self.comm.new_group(g, name=f"replica{i}") for i, g in enumerate(self.replica_ranks)]
        self.replica = groups[mine]
        if self.engine.replica_data_parallel or self.hierarchical:
            across = replicas.across_groups(self.replica_ranks)
            shards = [self.comm.new_group(g, name=f"shard{i}") for i, g in enumerate(across)]
            self.shards = shards[replicas.group_of(across, self.comm.rank)]

    def reduce_gradients(self, grads, params, flat=None):
        """Replica groups: the mean gradient of the group, every step (the engine's own data parallelism)."""
        return self.comm.allreduce([flat] if flat is not None else grads, op="mean", group=self.replica,
                                   async_op=True, tag="group-grad")

    def before_step(self) -> None:
        if self.outer is not None and not self.outer.anchored:  # first step: every rank's anchor, the mean
            with self.collective_context():
                self.outer.take_anchor(self.comm, self._sync_tensors(), group=self.shards)
            self._share_parts()
            self.tensors_changed()
        lr = self.lr()
        self._check_lr(lr)
        if self.outer is not None:  # the inner lr summed since each fragment was last sent (outer_normalize)
            self._lr_sums = [s + lr for s in self._lr_sums]
        if self.H is None:  # a round starts: its period from the lr of its first step (agreed inside Join)
            self.H = self.agree_on_period(qsr_period(self.step, lr, self.config))

    def _check_lr(self, lr: float) -> None:
        """Warn once if the lr still rises after ``warmup_steps``: the rule would read a warm-up lr as a decayed
        one and choose a long period."""
        previous, self._previous_lr = self._previous_lr, lr
        stepped = self.step - self.skipped_steps  # an engine may hold the lr back on skipped steps
        if (previous is not None and stepped > self.config.warmup_steps and lr > previous * (1 + 1e-6)
                and "rising" not in self._warned and not self.joined):
            self._warned.add("rising")
            warnings.warn(
                f"QSR: the lr is still rising at optimizer step {self.step} ({previous:.3g} -> {lr:.3g}), after "
                f"warmup_steps={self.config.warmup_steps}: the rule reads a warm-up lr as a decayed one and chooses "
                "long periods (few syncs); set warmup_steps to the length of your lr warm-up", stacklevel=user_stacklevel())

    def after_step(self) -> None:
        if self.H is None:  # a step that bypassed the pre-hook
            self.before_step()
        self.since_sync += 1
        if self.outer is None:
            if self.since_sync >= self.H:
                self.sync()
            return
        for k in self.outer.due(self.step):  # syncs sent overlap_steps ago land now
            self._apply_fragment(k)
        last = self.config.total_steps is not None and self.step >= self.config.total_steps
        if self.since_sync >= self.H and last and self.streaming:  # the run ends with identical weights
            self.flush()
            self._end_round(range(len(self.outer.outers)), blocking=True)
        elif self.since_sync >= self.H:
            self._end_round(send_points(self.H, len(self.outer.outers)).get(self.since_sync, []))
        else:
            for k in send_points(self.H, len(self.outer.outers)).get(self.since_sync, []):
                self._send_fragment(k)

    def sync_named(self) -> List[Tuple[str, torch.Tensor]]:
        """Parameters, floating buffers (``average_buffers``), optimizer moments (``average_optimizer_state``)."""
        named = list(self.named_params)
        if self.config.average_buffers:
            named += [(f"buffer{i}", b) for i, b in enumerate(float_buffers(self.module))]
        if self.config.average_optimizer_state:
            params = [p for _, p in self.named_params]
            moments = [m for opt in self.optimizers for m in optimizer_moments(opt, params, self.engine.master_slices)]
            named += [(f"moment{i}", m) for i, m in enumerate(moments)]
        return named

    def sync(self) -> None:
        """Average the model over the world now and start a new round (syncs in flight land first).

        With replica groups the ranks of a group already hold the same parameters, so the world mean is
        the mean over groups; buffers (BatchNorm statistics) still differ inside a group and need the
        world mean anyway.  When the engine shards inside the group (``replica_data_parallel``), each
        rank holds a different shard: it is averaged with the same shard of the other groups (one payload
        of the shard's size per rank), and the buffers over the world in a second call.
        """
        if self.outer is not None:
            self.flush()
            self._end_round(range(len(self.outer.outers)), blocking=True)
            return
        self.refresh_parameters()  # parameters unfrozen or added to the optimizer since: synced from now on
        named = self.sync_named()
        if self.shards is None:
            self.average([t for _, t in named], tag="sync")
        else:
            sharded, buffers = self._buffers_apart([t for _, t in named])
            if self.hierarchical:  # this rank's part of the parameters; moments whole (same inside a group)
                own = {id(p) for _, p in self.named_params}
                sharded = self._sync_tensors() + [t for t in sharded if id(t) not in own]
            self.average(sharded, group=self.shards, tag="sync")
            self._share_parts()
            if buffers:
                self.average(buffers, tag="sync-buffers")
        self.since_sync = 0
        self.H = None
        self.synced(group=self.shards)

    def _buffers_apart(self, tensors) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """``tensors`` split into (this rank's shard: parameters, optimizer moments; floating buffers): buffers
        differ inside a replica group and take the world mean."""
        buffers = {id(b) for b in float_buffers(self.module)}
        return [t for t in tensors if id(t) not in buffers], [t for t in tensors if id(t) in buffers]

    def _end_round(self, fragments, blocking: bool = False) -> None:
        """The round's last fragments are sent (blocking: applied too), buffers and optimizer moments
        averaged; a new round starts."""
        if self.refresh_parameters():
            raise ConfigError("QSR with outer_lr / outer_momentum / payload / overlap_steps / fragments: parameters "
                              "added or unfrozen during training are not supported (the anchor covers the "
                              "parameters of the first step)")
        fragments = list(fragments)
        for k in fragments:
            self._send_fragment(k, blocking=blocking)
        own = {id(p) for _, p in self.named_params}
        moments, buffers = self._buffers_apart([t for _, t in self.sync_named() if id(t) not in own])
        if buffers:  # buffers differ inside a replica group: the world mean
            self.average(buffers, tag="sync-buffers")
        if moments:  # optimizer moments belong to this rank's shard, like the parameters
            self.average(moments, group=self.shards, tag="sync-moments")
        self.since_sync = 0
        self.H = None
        if blocking and len(fragments) == len(self.outer.outers) or not self.streaming:
            self._complete_at = self.step
        self.synced(group=self.shards)

    def _send_fragment(self, k: int, blocking: bool = False) -> None:
        """Send fragment ``k``'s pseudo-gradient (proof inside); it lands ``overlap_steps`` steps later, never
        after ``total_steps``, at once if ``blocking``.  A previous sync of ``k`` still in flight lands first."""
        if k in self.outer.in_flight:
            self._apply_fragment(k)
        apply_at = self.step if blocking else self.step + self.config.overlap_steps
        if self.config.total_steps is not None:
            apply_at = min(apply_at, max(self.step, self.config.total_steps))
        scale = self._lr_sums[k] if self.config.outer_normalize == "lr_sum" and self._lr_sums[k] > 0 else 1.0
        self._lr_sums[k] = 0.0
        with self.collective_context():
            self.outer.send(k, self.comm, self._sync_tensors(), self.step_proof(), self.step, apply_at,
                            group=self.shards, tag="sync", seed=self.rounding_seed(), scale=scale)
        if apply_at <= self.step:
            self._apply_fragment(k)

    def _apply_fragment(self, k: int) -> None:
        with self.collective_context():
            proofs, sent_at = self.outer.apply(k, self._sync_tensors(), self.step)
        self._share_parts(k)
        self.check_proof(proofs, self.shards, "sync", step=sent_at)
        self.tensors_changed()

    def _params(self) -> List[torch.Tensor]:
        return [p for _, p in self.named_params]

    def flush(self) -> None:
        """Land every sync still in flight now (a forced sync and the end of a Join do it first).  Each rank
        keeps its local progress (``overlap_merge``): for identical weights call :meth:`sync`.  Collective:
        every rank calls it at the same step (as checkpoints are)."""
        if self.outer is not None:
            for k in sorted(self.outer.in_flight):
                self._apply_fragment(k)

    def final_sync(self) -> None:
        self.flush()
        super().final_sync()

    def in_sync_at(self) -> Optional[int]:
        """Streamed rounds (overlap, fragments) end with the ranks' weights apart: only a blocking sync of every
        fragment (the last round of ``total_steps``, a forced :meth:`sync`) makes them identical."""
        return self._complete_at if self.streaming else super().in_sync_at()

    def identical_named(self) -> List[Tuple[str, torch.Tensor]]:
        """With overlapped or fragmented syncs the ranks keep their local progress: the anchors are what agree."""
        if self.outer is None or not self.streaming:
            return self.sync_named()
        own = {id(p) for _, p in self.named_params}
        return self.outer.anchors() + [(n, t) for n, t in self.sync_named() if id(t) not in own]

    def algorithm_state_dict(self) -> dict:
        state = {"since_sync": self.since_sync, "H": self.H, "complete_at": self._complete_at,
                 "lr_sums": list(self._lr_sums)}
        if self.outer is not None:
            state["outer"] = self.outer.state_dict()
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        self.since_sync = int(state["since_sync"])
        self.H = None if state["H"] is None else int(state["H"])
        self._complete_at = state.get("complete_at")
        if "lr_sums" in state and len(state["lr_sums"]) == len(self._lr_sums):
            self._lr_sums = [float(v) for v in state["lr_sums"]]
        if self.outer is not None:
            self.outer.load_state_dict(state["outer"])

    def status(self) -> str:
        phase = "warm-up" if self.step < self.config.warmup_steps else "rule"
        return f"{phase} | H {self.H if self.H is not None else '-'} ({self.since_sync} since sync)"

    def algorithm_memory(self) -> Dict[str, int]:
        """Per fragment: anchor, outer momentum, error-feedback residual, the reused sync buffers; and, for a
        compressed payload in flight, the gathered payloads of the group (size x payload bytes) and the mean."""
        if self.outer is None:
            return {}
        out: Dict[str, int] = {}
        for o in self.outer.outers:
            for kind, n in o.memory().items():
                out[kind] = out.get(kind, 0) + n
        if self.config.payload != "fp32" and self.outer.in_flight:
            from .payload import payload_nbytes
            from .alignment import STEP_PROOF_BYTES

            size = self.comm.size if self.shards is None else self.shards.size
            numels = [sum(b - a for _, a, b in self.outer.fragments[k]) for k in self.outer.in_flight]
            out["in_flight"] = sum(size * (STEP_PROOF_BYTES + payload_nbytes(n, self.config.codec)) + 4 * n
                                   for n in numels)
        return out

    def algorithm_report(self) -> dict:
        gaps = [b - a for a, b in zip([0] + self.sync_steps[:-1], self.sync_steps)]
        return {"H": self.H, "since_sync": self.since_sync,
                "mean_H": round(sum(gaps) / len(gaps), 2) if gaps else None,
                "H_range": [min(gaps), max(gaps)] if gaps else None,
                "sync_fraction": round(self.syncs / self.step, 4) if self.step else None}

    def __repr__(self) -> str:
        return f"QSRState(step={self.step}, since_sync={self.since_sync}, H={self.H}, syncs={self.syncs})"


register_algorithm(QSRConfig, QSRState, traffic="commhooks.algorithms.qsr_traffic:qsr_traffic")
