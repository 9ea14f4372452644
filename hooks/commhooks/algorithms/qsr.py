"""QSR's state: local SGD / local AdamW whose ranks average their models every ``H`` optimizer steps, ``H``
chosen by the Quadratic Synchronisation Rule at the start of each round (arXiv 2310.14423; the rule, the keys
and the tuning advice: :mod:`.qsr_config`).

How a sync runs, read in this order: :meth:`QSRState.after_step` asks :func:`~.plan.step_events` for the
events of the step (land fragment k, send fragment k, end the round) and runs them on the
:class:`~.sync.SyncDriver`, which averages the weights or takes the outer step of each fragment
(:class:`~.sync.FragmentSync`); what a sync covers and how it travels was decided once, in the
:class:`~.plan.SyncPlan` the traffic declaration (:mod:`.qsr_traffic`) reads too.

Plain tensor math over a :class:`~commhooks.comm.Comm`; the engines drive it
through the :class:`~commhooks.algorithms.base.AlgorithmState` contract.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import torch

from ..comm import Group
from ..settings import ConfigError
from . import replicas, sync_state
from .averaging import float_buffers, optimizer_moments
from .base import AlgorithmState
from .parameters import user_stacklevel
from .plan import Event, SyncPlan, step_events
from .qsr_config import QSRConfig, qsr_period
from .sync import SyncDriver

__all__ = ["QSRConfig", "QSRState", "check_layout", "qsr_period"]


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
        return len(self.plan.groups) > 1

    @property
    def reduces_gradients(self) -> bool:
        """Only with replica groups of 2 or more, unless the engine averages inside them itself."""
        return self.replica.size > 1 and not self.engine.replica_data_parallel

    def setup(self) -> None:
        c = self.config
        origin = " (ranks per node, LOCAL_WORLD_SIZE)" if c.group_size is None else ""
        self.plan = SyncPlan.build(c, self.comm.size, self.comm.rank, self.engine.local_world_size,
                                   self.engine.replica_data_parallel, sum(p.numel() for _, p in self.named_params),
                                   self.outer_optimizer is not None, origin)
        self.since_sync = 0
        self.H: Optional[int] = None  # chosen at the first step of each round
        self._previous_lr: Optional[float] = None
        self._warned = set()  # warnings given once: "rising"
        check_layout(c, self.named_params, self.plan.hierarchical)
        self.driver = SyncDriver(self, self.plan, self._params, self._buffers, self._moments, c, self.outer_optimizer)
        self._lr_sums = [0.0] * c.fragments
        self._complete_at: Optional[int] = None  # last step after which every rank held the same weights
        if self.engine.buffers_synced_each_forward and float_buffers(self.module):
            warnings.warn(
                "the DDP model re-broadcasts buffers from rank 0 on every forward "
                "(broadcast_buffers / forward_sync_buffers=True): that is traffic on every step "
                "and overrides the local buffers; build DDP with forward_sync_buffers=False "
                "(torch>=2.13) or broadcast_buffers=False, QSR averages buffers at each sync",
                stacklevel=user_stacklevel(),
            )

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
        facts: dict = {"replica_groups": [tuple(g) for g in self.plan.groups]}
        if self.outer_optimizer is not None:
            probe = self.outer_optimizer([torch.zeros(1, device=self.device)])
            facts["outer_optimizer"] = [type(probe).__name__, repr(sorted(probe.defaults.items()))]
        return facts

    def start(self) -> None:
        plan, rank = self.plan, self.comm.rank
        self.shards = None  # the group of this rank's shard (or part) across replicas
        if len(plan.members) == 1:  # every rank its own replica: no group to create
            self.replica = Group(f"replica{plan.group}", plan.members)
        else:
            self.replica = [self.comm.new_group(g, name=f"replica{i}") for i, g in enumerate(plan.groups)][plan.group]
            if plan.sharded:
                across = replicas.across_groups(list(plan.groups))
                shards = [self.comm.new_group(g, name=f"shard{i}") for i, g in enumerate(across)]
                self.shards = shards[replicas.group_of(across, rank)]
        self.driver.across, self.driver.replica = self.shards, self.replica

    def start_group(self):
        """An engine sharding inside replica groups: each shard starts equal to its counterparts in the others."""
        return self.shards if self.engine.replica_data_parallel else None

    def reduce_gradients(self, grads, params, flat=None):
        """Replica groups: the mean gradient of the group, every step (the engine's own data parallelism)."""
        return self.comm.allreduce([flat] if flat is not None else grads, op="mean", group=self.replica,
                                   async_op=True, tag="group-grad")

    def before_step(self) -> None:
        if not self.driver.anchored:  # an outer step's first step: every rank's anchor
            self.driver.take_anchor()
        lr = self.lr()
        self._check_lr(lr)
        self._lr_sums = [s + lr for s in self._lr_sums]  # since each fragment was last sent (outer_normalize)
        if self.H is None:  # a round starts: its period from the lr of its first step (agreed inside Join)
            self.H = self.alignment.agree_on_period(qsr_period(self.step, lr, self.config))

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
        """The events of this step (:func:`~.plan.step_events`: syncs that are due land, fragments due leave, a
        round that ends closes; the run's last round of streamed syncs: one blocking sync of everything, so the
        run ends identical), run in order."""
        if self.H is None:  # a step that bypassed the pre-hook
            self.before_step()
        self.since_sync += 1
        self._run(step_events(self.step, self.since_sync, self.H, self.driver.in_flight, self.config))

    def copied_from_peer(self) -> None: self.driver.forget_own()  # noqa: E704 - the residuals were the peer's own

    def sync(self) -> None:
        """Average the model over the world now and start a new round (syncs in flight land first).

        With replica groups the ranks of a group already hold the same parameters, so the world mean is
        the mean over groups; buffers (BatchNorm statistics) still differ inside a group and need the
        world mean anyway.  When the engine shards inside the group (``replica_data_parallel``), each
        rank holds a different shard: it is averaged with the same shard of the other groups (one payload
        of the shard's size per rank), and the buffers over the world in a second call.
        """
        self._run(step_events(self.step, self.since_sync, self.H or 1, self.driver.in_flight, self.config,
                              force=True))

    def _run(self, events: List[Event]) -> None:
        """Run a step's events on the sync driver; the end of a round resets the round and counts the sync."""
        if events:
            self.parameter_set.repoint()
        for event in events:
            if event.kind == "land":
                self.driver.land(event.fragment)
            elif event.kind == "close":
                self.driver.close()
            elif event.kind == "send":
                k = event.fragment  # outer_normalize="lr_sum": the inner lr summed since the fragment last left
                scale = self._lr_sums[k] if self.config.outer_normalize == "lr_sum" and self._lr_sums[k] > 0 else 1.0
                self._lr_sums[k] = 0.0
                self.driver.send(k, event.at, scale)
            elif event.kind == "end":
                self.driver.end()
                self.since_sync, self.H = 0, None
                if event.complete:
                    self._complete_at = self.step
                self.synced(group=self.shards)
            else:
                raise ValueError(f"unknown sync event {event!r}")

    def sync_named(self) -> List[Tuple[str, torch.Tensor]]:
        """Parameters, floating buffers (``average_buffers``), optimizer moments (``average_optimizer_state``)."""
        return list(self.named_params) + self.driver.named_extras()

    def flush(self) -> None:
        """Land every sync still in flight now (a forced sync and the end of a Join do it first).  Each rank
        keeps its local progress (``overlap_merge``): for identical weights call :meth:`sync`.  Collective:
        every rank calls it at the same step (as checkpoints are)."""
        for k in sorted(self.driver.in_flight):
            self.driver.land(k)

    def final_sync(self) -> None:
        self.flush()
        super().final_sync()

    def in_sync_at(self) -> Optional[int]:
        """Streamed rounds (overlap, fragments) end with the ranks' weights apart: only a blocking sync of every
        fragment (the last round of ``total_steps``, a forced :meth:`sync`) makes them identical."""
        return self._complete_at if self.plan.streaming else super().in_sync_at()

    def identical_named(self) -> List[Tuple[str, torch.Tensor]]:
        """With overlapped or fragmented syncs the ranks keep their local progress: the anchors are what agree."""
        return self.driver.identical_named(self.named_params)

    def algorithm_state_dict(self) -> dict:
        state = {"since_sync": self.since_sync, "H": self.H, "complete_at": self._complete_at,
                 "lr_sums": list(self._lr_sums)}
        outer = sync_state.save(self.driver)
        if outer is not None:
            state["outer"] = outer
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        self.since_sync = int(state["since_sync"])
        self.H = None if state["H"] is None else int(state["H"])
        self._complete_at = state.get("complete_at")
        if "lr_sums" in state and len(state["lr_sums"]) == len(self._lr_sums):
            self._lr_sums = [float(v) for v in state["lr_sums"]]
        sync_state.load(self.driver, state.get("outer"))

    def status(self) -> str:
        phase = "warm-up" if self.step < self.config.warmup_steps else "rule"
        return f"{phase} | H {self.H if self.H is not None else '-'} ({self.since_sync} since sync)"

    def algorithm_memory(self) -> Dict[str, int]:
        """Per fragment: anchor, outer momentum, error-feedback residual, the reused sync buffers; and, for a
        compressed payload in flight, the gathered payloads of the group (size x payload bytes) and the mean."""
        return sync_state.memory(self.driver, self.comm.size if self.shards is None else self.shards.size)

    def algorithm_report(self) -> dict:
        gaps = [b - a for a, b in zip([0] + self.sync_steps[:-1], self.sync_steps)]
        return {"H": self.H, "since_sync": self.since_sync,
                "mean_H": round(sum(gaps) / len(gaps), 2) if gaps else None,
                "H_range": [min(gaps), max(gaps)] if gaps else None,
                "sync_fraction": round(self.syncs / self.step, 4) if self.step else None}

    def __repr__(self) -> str:
        return f"QSRState(step={self.step}, since_sync={self.since_sync}, H={self.H}, syncs={self.syncs})"
