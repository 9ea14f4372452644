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
from typing import ClassVar, Dict, List, Literal, Optional, Tuple

import torch
from pydantic import Field
from typing_extensions import Annotated

from .averaging import float_buffers, optimizer_moments
from ..comm import Group
from . import replicas, run_end
from ..config import ConfigError
from .base import AlgorithmState
from .helpers import user_stacklevel
from .outer import OuterSync
from .payload import PayloadFields
from .pipeline import MeanSync, OuterSteps, RoundSchedule, SyncCover
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
    def streaming(self) -> bool:
        """True when a round can end with the ranks' weights apart (overlapped or fragmented syncs)."""
        return self.overlap_steps > 0 or self.fragments > 1

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

    def __init__(self, optimizer, *, outer_optimizer=None, **kwargs):
        """``outer_optimizer``: ``params -> torch.optim optimizer`` to take the DiLoCo outer step in place of the
        built-in SGD with (Nesterov) momentum, as in torchft (e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.7,
        momentum=0.9, nesterov=True)``, which takes the built-in's steps); it replaces ``outer_lr``,
        ``outer_momentum`` and ``outer_nesterov``.  Python only: a JSON config names no optimizer."""
        self.outer_optimizer = outer_optimizer
        super().__init__(optimizer, **kwargs)

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
        mine = self.replica_ranks[replicas.group_of(self.replica_ranks, self.comm.rank)]
        self.hierarchical = c.hierarchical and len(mine) > 1 and not self.engine.replica_data_parallel
        if self.hierarchical:
            self._require_contiguous("qsr.hierarchical needs", "a rank's part", "hierarchical false")
        self.cover = SyncCover(self._params, self._buffers, self._moments, mine, self.comm.rank, self.hierarchical)
        self.transport = OuterSteps(
            self, self.cover, lambda: OuterSync(c.outer_lr, c.outer_momentum, c.outer_nesterov, c.codec,
                                                c.payload_block, c.error_feedback, keep_sent_from=c.overlap_steps > 0,
                                                make_optimizer=self.outer_optimizer),
            c.fragments, c.overlap_merge, c.overlap_alpha, c.streaming
        ) if c.pseudo_gradient or self.outer_optimizer is not None else MeanSync(self, self.cover)
        self.schedule = RoundSchedule(c)
        self._lr_sums = [0.0] * self.transport.fragments
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

    def _require_contiguous(self, what: str, piece: str, instead: str) -> None:
        """ConfigError naming the non-contiguous parameters: ``piece`` would be a view of them."""
        bent = [n for n, p in self.named_params if not p.is_contiguous()]
        if bent:
            raise ConfigError(f"{what} contiguous parameters ({piece} is a view of them); not contiguous: "
                              f"{bent[:4]} (e.g. channels_last): use {instead}")

    def _params(self) -> List[torch.Tensor]:
        return [p for _, p in self.named_params]

    def _buffers(self) -> List[torch.Tensor]:
        """Floating buffers (BatchNorm statistics), averaged at each sync with ``average_buffers``."""
        return float_buffers(self.module) if self.config.average_buffers else []

    def _moments(self) -> List[torch.Tensor]:
        """Optimizer moments of the parameters, averaged at each sync with ``average_optimizer_state``."""
        if not self.config.average_optimizer_state:
            return []
        params = self._params()
        return [m for opt in self.optimizers for m in optimizer_moments(opt, params, self.engine.master_slices)]

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

    def validate(self) -> None:
        c = self.config
        builtin = sorted({"outer_lr", "outer_momentum", "outer_nesterov"} & c.model_fields_set)
        if self.outer_optimizer is not None and builtin:
            raise ConfigError(f"{', '.join(f'qsr.{k} ({getattr(c, k)})' for k in builtin)}: the built-in outer step's; "
                              "with outer_optimizer= set them in that optimizer (leave the keys out)")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise ConfigError("outer_optimizer must be a function params -> torch.optim optimizer, got "
                              f"{type(self.outer_optimizer).__name__}")

    def describe(self) -> dict:
        """The replica groups; and the outer optimizer's class and settings, which every rank must share."""
        facts: dict = {"replica_groups": self.replica_ranks}
        if self.outer_optimizer is not None:
            probe = self.outer_optimizer([torch.zeros(1, device=self.device)])
            facts["outer_optimizer"] = [type(probe).__name__, repr(sorted(probe.defaults.items()))]
        return facts

    def start(self) -> None:
        mine = replicas.group_of(self.replica_ranks, self.comm.rank)
        self.shards = None  # the group of this rank's shard across replicas, when the engine shards
        if len(self.replica_ranks[mine]) == 1:  # every rank its own replica: no group to create
            self.replica = Group(f"replica{mine}", self.replica_ranks[mine])
        else:
            groups = [self.comm.new_group(g, name=f"replica{i}") for i, g in enumerate(self.replica_ranks)]
            self.replica = groups[mine]
            if self.engine.replica_data_parallel or self.hierarchical:
                across = replicas.across_groups(self.replica_ranks)
                shards = [self.comm.new_group(g, name=f"shard{i}") for i, g in enumerate(across)]
                self.shards = shards[replicas.group_of(across, self.comm.rank)]
        self.cover.across, self.cover.replica = self.shards, self.replica

    def start_group(self):
        """An engine sharding inside replica groups: each shard starts equal to its counterparts in the others."""
        return self.shards if self.engine.replica_data_parallel else None

    @property
    def outer(self):
        """The fragments' outer states and syncs in flight (:class:`~.pipeline.StreamedSyncs`), or None when a
        sync is a plain mean."""
        return getattr(self.transport, "streams", None)

    @property
    def streaming(self) -> bool:
        return self.schedule.streaming

    def reduce_gradients(self, grads, params, flat=None):
        """Replica groups: the mean gradient of the group, every step (the engine's own data parallelism)."""
        return self.comm.allreduce([flat] if flat is not None else grads, op="mean", group=self.replica,
                                   async_op=True, tag="group-grad")

    def before_step(self) -> None:
        if not self.transport.anchored:  # first step: every rank's anchor, the mean
            self.transport.take_anchor()
        lr = self.lr()
        self._check_lr(lr)
        self._lr_sums = [s + lr for s in self._lr_sums]  # since each fragment was last sent (outer_normalize)
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
        """Land what is due, send what the schedule says; at the round's end close it (the run's last round of
        streamed syncs: one blocking sync of everything, so the run ends identical)."""
        if self.H is None:  # a step that bypassed the pre-hook
            self.before_step()
        self.since_sync += 1
        for k in self.transport.due(self.step):  # syncs sent overlap_steps ago land now
            self.transport.land(k)
        if self.since_sync < self.H:
            for k in self.schedule.sends(self.since_sync, self.H):
                self._send(k)
        elif self.schedule.ends_run(self.step):
            self.sync()
        else:  # the fragments scheduled at the round's last step
            self._end_round(self.schedule.sends(self.H, self.H))

    def sync_named(self) -> List[Tuple[str, torch.Tensor]]:
        """Parameters, floating buffers (``average_buffers``), optimizer moments (``average_optimizer_state``)."""
        return self.cover.named(self.named_params)

    def sync(self) -> None:
        """Average the model over the world now and start a new round (syncs in flight land first).

        With replica groups the ranks of a group already hold the same parameters, so the world mean is
        the mean over groups; buffers (BatchNorm statistics) still differ inside a group and need the
        world mean anyway.  When the engine shards inside the group (``replica_data_parallel``), each
        rank holds a different shard: it is averaged with the same shard of the other groups (one payload
        of the shard's size per rank), and the buffers over the world in a second call.
        """
        self.flush()
        self._end_round(range(self.transport.fragments), blocking=True)

    def _end_round(self, fragments, blocking: bool = False) -> None:
        """The round's last fragments are sent (blocking: landed too), buffers and optimizer moments averaged
        as the transport does; a new round starts.  Parameters unfrozen or added to the optimizer since the last
        sync join a plain mean (an outer step refuses them)."""
        self.transport.check_new_parameters(self.refresh_parameters())
        fragments = list(fragments)
        for k in fragments:
            self._send(k, blocking=blocking)
        self.transport.finish_round()
        self.since_sync = 0
        self.H = None
        if blocking and len(fragments) == self.transport.fragments or not self.streaming:
            self._complete_at = self.step
            run_end.note_the_end(self)
        self.synced(group=self.shards)

    def _send(self, k: int, blocking: bool = False) -> None:
        """Send fragment ``k`` (proof inside); it lands when the schedule says (at once if ``blocking``).  A
        previous sync of ``k`` still in flight lands first."""
        if k in self.transport.in_flight:
            self.transport.land(k)
        apply_at = self.schedule.lands_at(self.step, blocking)
        scale = self._lr_sums[k] if self.config.outer_normalize == "lr_sum" and self._lr_sums[k] > 0 else 1.0
        self._lr_sums[k] = 0.0
        self.transport.send(k, apply_at, scale)
        if apply_at <= self.step:
            self.transport.land(k)

    def flush(self) -> None:
        """Land every sync still in flight now (a forced sync and the end of a Join do it first).  Each rank
        keeps its local progress (``overlap_merge``): for identical weights call :meth:`sync`.  Collective:
        every rank calls it at the same step (as checkpoints are)."""
        for k in sorted(self.transport.in_flight):
            self.transport.land(k)

    def final_sync(self) -> None:
        self.flush()
        super().final_sync()

    def in_sync_at(self) -> Optional[int]:
        """Streamed rounds (overlap, fragments) end with the ranks' weights apart: only a blocking sync of every
        fragment (the last round of ``total_steps``, a forced :meth:`sync`) makes them identical."""
        return self._complete_at if self.streaming else super().in_sync_at()

    def identical_named(self) -> List[Tuple[str, torch.Tensor]]:
        """With overlapped or fragmented syncs the ranks keep their local progress: the anchors are what agree."""
        return self.transport.identical_named(self.named_params)

    def algorithm_state_dict(self) -> dict:
        state = {"since_sync": self.since_sync, "H": self.H, "complete_at": self._complete_at,
                 "lr_sums": list(self._lr_sums)}
        outer = self.transport.state_dict()
        if outer is not None:
            state["outer"] = outer
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        self.since_sync = int(state["since_sync"])
        self.H = None if state["H"] is None else int(state["H"])
        self._complete_at = state.get("complete_at")
        if "lr_sums" in state and len(state["lr_sums"]) == len(self._lr_sums):
            self._lr_sums = [float(v) for v in state["lr_sums"]]
        self.transport.load_state_dict(state.get("outer"))

    def status(self) -> str:
        phase = "warm-up" if self.step < self.config.warmup_steps else "rule"
        return f"{phase} | H {self.H if self.H is not None else '-'} ({self.since_sync} since sync)"

    def algorithm_memory(self) -> Dict[str, int]:
        """Per fragment: anchor, outer momentum, error-feedback residual, the reused sync buffers; and, for a
        compressed payload in flight, the gathered payloads of the group (size x payload bytes) and the mean."""
        return self.transport.memory(self.comm.size if self.shards is None else self.shards.size)

    def algorithm_report(self) -> dict:
        gaps = [b - a for a, b in zip([0] + self.sync_steps[:-1], self.sync_steps)]
        return {"H": self.H, "since_sync": self.since_sync,
                "mean_H": round(sum(gaps) / len(gaps), 2) if gaps else None,
                "H_range": [min(gaps), max(gaps)] if gaps else None,
                "sync_fraction": round(self.syncs / self.step, 4) if self.step else None}

    def __repr__(self) -> str:
        return f"QSRState(step={self.step}, since_sync={self.since_sync}, H={self.H}, syncs={self.syncs})"
