"""QSR's state: local SGD / local AdamW whose ranks average their models every ``H`` optimizer steps, ``H`` chosen
by the Quadratic Synchronisation Rule at the start of each round (arXiv 2310.14423; the keys and the tuning advice:
:mod:`.config`), and the round itself as a value.

How a sync runs, read in this order: :meth:`QSRState.before_step` starts a round (its period from the rule and the
lr of its first step); :meth:`QSRState.after_step` advances the :class:`Round`, which returns the step's events
(land fragment k, close the round, send fragment k, end the round: :func:`step_events`), and runs them on the
:class:`~.sync.SyncDriver`.  The traffic declaration (:mod:`.traffic`) replays the same :class:`Round`, so when a
sync happens is written once.

**Timeline** of one round with ``fragments=3, overlap_steps=1`` and a period ``H=6`` (``sN``: fragment N sent after
that step, ``lN``: it lands after that step, before the next optimizer step)::

    step of round   1    2    3    4    5    6  | 1 (next round)
    sent                 s0        s1        s2 |         overlap_schedule "land-after" (the default)
    landed                    l0        l1      | l2
    sent early      s0        s1        s2      |         "send-before" (torchft's fragment_sync_delay)
    landed early         l0        l1        l2 |

Fragment ``k`` of ``F`` leaves after step ``ceil(H (k + 1) / F)`` of the round (:func:`send_points`) and lands
``overlap_steps`` later, never after ``total_steps`` (the last round of a known run sends and lands everything at
once: the ranks end identical).  A fragment still in flight lands before it is sent again.  With ``fragments=1,
overlap_steps=0``: one blocking sync at the round's end.  The logger ``commhooks`` at DEBUG prints one line per
fragment sent and landed (a test reads this table against them).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from ...comm import Group
from ...settings import ConfigError
from .. import replicas
from ..averaging import float_buffers, optimizer_moments
from ..contract import AlgorithmState
from ..contract.parameters import user_stacklevel
from .saved import QSRKept
from .config import QSRConfig
from .plan import SyncPlan, check_layout
from .sync import SyncDriver

__all__ = ["QSRConfig", "QSRState", "Round", "qsr_period", "rule_period"]
NEVER = 2**62  # a period that never ends (lr 0 and no total_steps)


def rule_period(step: int, lr: float, fields, h_base: int, shorten_by: int = 0, floor: int = 1) -> int:
    """The quadratic rule ``max(h_base, floor((alpha / lr) ** power))`` for a round starting at ``step`` with
    ``lr`` (``fields``: a config with the rule's keys; ``alpha = 0``: ``h_base``; ``lr <= 0``: never), less
    ``shorten_by``, capped at ``total_steps - step``, at least ``floor``.  AB x QSR sizes its phases by it too."""
    h = h_base
    if fields.alpha != 0.0:
        ratio = (fields.alpha / lr) ** fields.power if lr > 0.0 else math.inf  # a zero lr: local steps never drift
        h = max(h_base, math.floor(ratio) if math.isfinite(ratio) else math.inf)
    h -= shorten_by
    if fields.total_steps is not None:
        h = min(h, fields.total_steps - step)
    return max(floor, int(min(h, NEVER)))


def qsr_period(step: int, lr: float, config: QSRConfig) -> int:
    """The period of the round that starts after ``step`` optimizer steps, whose first step uses ``lr``."""
    return config.warmup_h if step < config.warmup_steps else rule_period(step, lr, config, config.h_base)


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing a step does: ``land`` fragment k (``complete``: the run's last or a forced sync, which lands the
    synced weights, unmixed); ``close`` the round (parameters that joined are taken in); ``send`` fragment k,
    landing after step ``at``; ``end`` the round (``complete``: the ranks now agree)."""

    kind: str
    fragment: int = 0
    at: int = 0
    complete: bool = False


def send_points(period: int, count: int, early: int = 0) -> Dict[int, List[int]]:
    """Step of the round (1..period) -> fragments sent after it: fragment k's point is ``ceil(period (k + 1) /
    count)`` (the last fragment's the round's end), and a sync sent ``early`` steps before its point (the
    ``send-before`` schedule) leaves that much sooner, never before the round's first step."""
    points: Dict[int, List[int]] = {}
    for k in range(count):
        points.setdefault(max(1, math.ceil(period * (k + 1) / count) - early), []).append(k)
    return points


def step_events(step: int, since: int, period: int, in_flight: Mapping[int, int], config, streaming: bool,
                force: bool = False) -> List[Event]:
    """The events of optimizer ``step``, step ``since`` of a round of ``period``, with ``in_flight`` (fragment ->
    the step it lands at), in the order they run; ``force``: a sync of everything now (``sync()``).

    Syncs due land first; a round that ends closes, sends its last fragments (the run's last round of streamed
    syncs, or a forced sync: every fragment, blocking, after everything in flight has landed) and ends;
    otherwise the fragments due at this step of the round are sent."""
    flying, events = dict(in_flight), []
    ending = force or since >= period
    total = config.total_steps
    blocking = force or (ending and streaming and total is not None and step >= total)
    # due syncs land first (all, in fragment order, for a forced sync); for a blocking end, the rest after them
    due = []
    for k, at in in_flight.items():
        if force or at <= step:
            due.append(k)
    due.sort()
    for k in due + (sorted(set(flying) - set(due)) if blocking else []):
        events.append(Event("land", k))
        flying.pop(k)
    if ending:
        events.append(Event("close"))
    # send-before (torchft's timeline): each sync leaves overlap_steps before its point and lands on it
    before = config.overlap_schedule == "send-before" and config.overlap_steps > 0
    key = period if ending else since
    sends = range(config.fragments) if blocking else send_points(
        period, config.fragments, config.overlap_steps if before else 0).get(key, [])
    for k in sends:
        if k in flying:
            events.append(Event("land", k))
            flying.pop(k)
        point = step - key + math.ceil(period * (k + 1) / config.fragments)  # the step fragment k's sync is for
        at = step if blocking else (max(step, point) if before else step + config.overlap_steps)
        at = at if total is None else min(at, max(step, total))  # never past the run's end
        events.append(Event("send", k, at))
        if at <= step:
            events.append(Event("land", k, complete=blocking))  # (a blocking end lands the synced weights)
        else:
            flying[k] = at
    if ending:
        events.append(Event("end", complete=blocking or not streaming))
    return events


@dataclasses.dataclass
class Round:
    """Where the sync schedule stands: the period chosen at the round's first step (``None`` until then), the
    steps of the round done, the syncs in flight (fragment -> the step it lands at), and whether the anchor of
    an outer step was taken.  The state advances it step by step; the traffic declaration replays it."""

    period: Optional[int] = None
    since: int = 0
    in_flight: Dict[int, int] = dataclasses.field(default_factory=dict)
    anchored: bool = False

    def anchor_due(self, outer_step: bool) -> bool:
        """True once, at the first step of a run whose syncs are outer steps (it then takes its anchor)."""
        due, self.anchored = outer_step and not self.anchored, True
        return due

    def begin(self, step: int, lr: float, config, agree=None) -> None:
        """Before optimizer step ``step + 1``, when no round is open: one starts, its period from the rule
        (``agree``: the ranks' max of it)."""
        period = qsr_period(step, lr, config)
        self.period = period if agree is None else agree(period)

    def advance(self, step: int, config, streaming: bool, force: bool = False) -> List[Event]:
        """After optimizer ``step``: this step's events (``force``: a sync of everything now), the round moved
        past them (what is in flight; a round that ends starts afresh)."""
        if not force:
            self.since += 1
        events = step_events(step, self.since, self.period or 1, self.in_flight, config, streaming, force)
        for event in events:
            if event.kind == "send" and event.at > step:
                self.in_flight[event.fragment] = event.at
            elif event.kind == "land":
                self.in_flight.pop(event.fragment, None)
            elif event.kind == "end":
                self.period, self.since = None, 0
        return events


class QSRState(QSRKept, AlgorithmState):
    """Hook state for QSR-gated local SGD.

    One line after building the DDP model and the optimizer::

        state = commhooks.ddp.register(ddp_model, optimizer, {"type": "qsr", "alpha": 0.0175, "h_base": 4})

    or by hand: ``state = commhooks.QSRState(optimizer, model=ddp_model, alpha=0.0175, h_base=4)`` and
    ``ddp_model.register_comm_hook(state, commhooks.qsr_hook)`` (``model`` is optional: give it so BatchNorm
    buffers are averaged).  Keyword arguments are the fields of :class:`QSRConfig`; ``config=`` takes a config
    object, dict or JSON path.  Steps are counted by the optimizer post-hook (``no_sync()`` accumulation counts
    optimizer steps); a round's period is chosen in the pre-hook of its first step, after your
    ``scheduler.step()`` has set the lr that step uses.
    """

    engine_data_parallel = True  # an engine may run its own data parallelism (and ZeRO) inside each replica group

    @classmethod
    def groups_needed(cls, config, world_size, local_world_size):
        size = replicas.resolve_size(config.group_size, world_size, local_world_size)
        groups = replicas.contiguous_groups(size, world_size, "qsr.group_size")
        if config.hierarchical and size > 1:  # each rank's part meets the same part of the other groups
            groups = groups + replicas.across_groups(groups)
        return groups

    def __init__(self, optimizer, *, outer_optimizer=None, **kwargs):
        """``outer_optimizer``: ``params -> torch.optim optimizer`` to take the DiLoCo outer step in place of the
        built-in SGD with (Nesterov) momentum, as in torchft (``lambda ps: torch.optim.SGD(ps, lr=0.7,
        momentum=0.9, nesterov=True)`` takes the built-in's steps); it replaces ``outer_lr``,
        ``outer_momentum`` and ``outer_nesterov``.  Python only: a JSON config names no optimizer."""
        self.outer_optimizer = outer_optimizer
        super().__init__(optimizer, **kwargs)

    @property
    def runs_apart(self) -> bool:
        """Between syncs each replica group's model is its own (unless the world is one group)."""
        return len(self.plan.groups) > 1

    def validate(self) -> None:
        c = self.config
        builtin = sorted({"outer_lr", "outer_momentum", "outer_nesterov"} & c.model_fields_set)
        if self.outer_optimizer is not None and builtin:
            raise ConfigError(f"{', '.join(f'qsr.{k} ({getattr(c, k)})' for k in builtin)}: the built-in outer step's; "
                              "with outer_optimizer= set them in that optimizer (leave the keys out)")
        if c.outer_normalize != "none" and c.outer_momentum == 0.0 and self.outer_optimizer is None:
            raise ConfigError(f"qsr.outer_normalize {c.outer_normalize!r} has no effect here: it acts only with an "
                              "outer momentum (outer_momentum > 0, or an outer_optimizer= that keeps state): the "
                              "step it scales back is the pseudo-gradient itself (set what it needs, or leave it out)")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise ConfigError("outer_optimizer must be a function params -> torch.optim optimizer, got "
                              f"{type(self.outer_optimizer).__name__}")

    def setup(self) -> None:
        c, engine = self.config, self.engine
        origin = " (ranks per node, LOCAL_WORLD_SIZE)" if c.group_size is None else ""
        self.plan = SyncPlan.build(c, self.comm.size, self.comm.rank, engine.local_world_size,
                                   engine.replica_data_parallel, sum(p.numel() for _, p in self.named_params),
                                   self.outer_optimizer is not None, origin)
        if len(self.plan.groups) == 1 and self.comm.size > 1:  # measured: a GPT sweep of periods gave one loss
            size = "null" if c.group_size is None else c.group_size
            warnings.warn(f"QSR: all {self.comm.size} ranks form one replica group (group_size {size}{origin}): "
                          "every step averages over the whole world, as DDP does, "
                          "and the syncs have no other group to meet, so alpha and h_base change nothing; set "
                          "group_size to 1 (every rank its own replica) or to the ranks of a node on several nodes",
                          stacklevel=user_stacklevel())
        # the replica group's gradient mean each step: groups of 2 or more, unless the engine averages inside them
        self.reduces_gradients = len(self.plan.members) > 1 and not engine.replica_data_parallel
        self.round, self.previous_lr, self.warned_rising = Round(), None, False
        self.complete_at: Optional[int] = None  # the last step a sync left every rank with the same weights
        self.lr_sums = [0.0] * c.fragments  # the inner lr summed since each fragment last left (outer_normalize)
        check_layout(c, self.named_params, self.plan.hierarchical)
        ps, module = self.parameter_set, self.module

        def buffers() -> List[torch.Tensor]:  # floating ones (BatchNorm statistics), averaged with average_buffers
            out = []
            for b in module.buffers():
                if torch.is_floating_point(b):
                    out.append(b)
            return out

        moments = (lambda: [m for opt in self.optimizers for m in optimizer_moments(  # average_optimizer_state
            opt, ps.tensors, engine.master_slices)]) if c.average_optimizer_state else list
        self.driver = SyncDriver(self.sync_context, self.plan, ps, buffers if c.average_buffers and module is not None
                                 else list, moments, c, self.outer_optimizer)
        if engine.buffers_synced_each_forward and float_buffers(module):
            warnings.warn("the DDP model re-broadcasts buffers from rank 0 on every forward (broadcast_buffers / "
                          "forward_sync_buffers=True): that is traffic on every step and overrides the local "
                          "buffers; build DDP with forward_sync_buffers=False (torch>=2.13) or broadcast_buffers="
                          "False, QSR averages buffers at each sync", stacklevel=user_stacklevel())

    def describe(self) -> dict:
        """The replica groups; and the outer optimizer's class and settings, which every rank must share."""
        facts: dict = {"replica_groups": [tuple(g) for g in self.plan.groups]}
        if self.outer_optimizer is not None:
            probe = self.outer_optimizer([torch.zeros(1, device=self.device)])
            facts["outer_optimizer"] = [type(probe).__name__, repr(sorted(probe.defaults.items()))]
        return facts

    def start(self) -> None:
        plan, new = self.plan, self.comm.new_group
        self.shards = None  # the group of this rank's shard (or part) across replicas
        if len(plan.members) == 1:  # every rank its own replica: no group to create
            self.replica = Group(f"replica{plan.group}", plan.members)
        else:
            self.replica = [new(g, name=f"replica{i}") for i, g in enumerate(plan.groups)][plan.group]
            if plan.sharded:
                across = replicas.across_groups(list(plan.groups))
                self.shards = [new(g, name=f"shard{i}") for i, g in enumerate(across)][plan.member]
        self.driver.across, self.driver.replica = self.shards, self.replica

    def start_group(self):
        """An engine sharding inside replica groups: each shard starts equal to its counterparts in the others."""
        return self.shards if self.engine.replica_data_parallel else None

    def reduce_gradients(self, grads, params, flat=None):
        """Replica groups: the mean gradient of the group, every step (the engine's own data parallelism)."""
        return self.comm.allreduce([flat] if flat is not None else grads, op="mean", group=self.replica,
                                   async_op=True, tag="group-grad")

    def before_step(self) -> None:
        ctx, rnd, lr = self.sync_context, self.round, self.sync_context.lr()
        if not rnd.anchored and rnd.anchor_due(self.plan.outer_step):  # an outer step's first step: the anchor
            self.driver.take_anchor()
        previous, self.previous_lr = self.previous_lr, lr
        if previous is not None and lr > previous * (1 + 1e-6) and not self.warned_rising:
            self.warn_rising(previous, lr)
        for k in range(len(self.lr_sums)):
            self.lr_sums[k] += lr
        if rnd.period is None:  # a round starts: its period from the lr of its first step
            rnd.begin(ctx.step, lr, self.config, self.alignment.agree_on_period)

    def warn_rising(self, previous: float, lr: float) -> None:
        """Once, if the lr still rises after ``warmup_steps``: the rule would read a warm-up lr as a decayed one."""
        if self.step - self.skipped_steps > self.config.warmup_steps and not self.joined:  # (skipped: lr held)
            self.warned_rising = True
            warnings.warn(f"QSR: the lr is still rising at optimizer step {self.step} ({previous:.3g} -> {lr:.3g}), "
                          f"after warmup_steps={self.config.warmup_steps}: the rule reads a warm-up lr as a decayed "
                          "one and chooses long periods (few syncs); set warmup_steps to the length of your lr "
                          "warm-up", stacklevel=user_stacklevel())

    def after_step(self) -> None:
        """The events of this step, run in order (:meth:`Round.advance`)."""
        if self.round.period is None:  # a step that bypassed the pre-hook
            self.before_step()
        self.run(self.round.advance(self.sync_context.step, self.config, self.plan.streaming))

    def sync(self) -> None:
        """Average the model over the world now and start a new round (syncs in flight land first).  With replica
        groups the world mean is the mean over groups (and the buffers' over the world); an engine sharding
        inside the group has each shard averaged with the same shard of the other groups."""
        self.run(self.round.advance(self.sync_context.step, self.config, self.plan.streaming, force=True))

    def run(self, events: List[Event]) -> None:
        """Run a step's events on the sync driver; the end of a round counts the sync."""
        if events and self.parameter_set.slices:  # views of an engine's tensors: take them again if moved
            self.parameter_set.repoint()
        for event in events:
            if event.kind == "land":
                self.driver.land(event.fragment, mix=not event.complete)
            elif event.kind == "close":
                self.driver.close()
            elif event.kind == "send":
                k, sums = event.fragment, self.lr_sums  # outer_normalize="lr_sum": the inner lr since k last left
                scale = sums[k] if self.config.outer_normalize == "lr_sum" and sums[k] > 0 else 1.0
                sums[k] = 0.0
                self.driver.send(k, event.at, scale)
            else:
                self.driver.end()
                self.sync_context.synced(self.shards, event.complete)
                self.complete_at = self.sync_context.step if event.complete else self.complete_at

    def flush(self) -> None:
        """Land every sync still in flight now (a forced sync and the end of a Join do it first).  Each rank keeps
        its local progress (``overlap_merge``): for identical weights call :meth:`sync`.  Collective."""
        for k in sorted(self.round.in_flight):
            self.driver.land(k)
        self.round.in_flight.clear()

    def final_sync(self) -> None:
        self.flush()
        super().final_sync()

    def copied_from_peer(self) -> None:
        self.driver.forget_own()  # the error-feedback residuals were the peer's own

    def sync_named(self) -> List[Tuple[str, torch.Tensor]]:
        """Parameters, floating buffers (``average_buffers``), optimizer moments (``average_optimizer_state``)."""
        return list(self.named_params) + self.driver.named_extras()

    def identical_named(self) -> List[Tuple[str, torch.Tensor]]:
        """With overlapped or fragmented syncs the ranks keep their local progress: the anchors are what agree."""
        return self.driver.identical_named(self.named_params)

    since_sync = property(lambda self: self.round.since, doc="Optimizer steps of the open round done.")
    H = property(lambda self: self.round.period, doc="The open round's period (None between rounds).")

    def __repr__(self) -> str:
        return f"QSRState(step={self.step}, since_sync={self.since_sync}, H={self.H}, syncs={self.syncs})"
