"""Every step and every sync, from the contract's side: the optimizer step hooks, and the narrow context a sync gets.

Local methods issue collectives at points each rank computes for itself, so a rank that takes a different number of
steps pairs the wrong collectives.  The one contract module a step runs through: :class:`StepAlignment` (the
optimizer step hooks: GradScaler, strays, the NaN/Inf guard, counting), :class:`NonfiniteGuard` (NaN/Inf kept on
the device, read only at a sync or a checkpoint), :class:`SyncContext` (all a sync needs; never the state).

**The step proof** rides in every sync's payload (a few float32 elements of the same call): the step in base 64
(three limbs and their squares: ranks agree iff ``n * sum(x^2) == (sum x)^2`` for each, the same verdict on every
rank), log2 of the GradScaler scale and its square, and 1 if the rank saw a NaN/Inf gradient since its last sync.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...comm import CollectiveError
from ..averaging import average_
from .checks import DivergenceError, count_everywhere, first_bad, nonfinite_error, nonfinite_message, verify_identical
from ...phases import PhaseClock

_LIMBS = 3  # steps below 262,144 compared exactly, beyond that modulo it
_SCALE, _NONFINITE = 2 * _LIMBS + 1, 2 * _LIMBS + 3  # indices of log2(scale) (its square follows), the NaN flag
PROOF_ELEMENTS = _NONFINITE + 1
STEP_PROOF_BYTES = 4 * PROOF_ELEMENTS  # added to the payload of every sync
LIKELY_CAUSES = (
    "likely causes: a rank called optimizer.step() a different number of times (an extra or a missing step, a second "
    "optimizer stepped on one rank only), uneven inputs without `with torch.distributed.algorithms.join.Join("
    "[ddp_model, state])`, or a GradScaler-like wrapper that skips optimizer.step() on some ranks "
    "(torch.amp.GradScaler itself is handled)")
_COLLECTIVE_HINT = ("if a peer has finished its data (uneven inputs), wrap the loop in "
                    "`with torch.distributed.algorithms.join.Join([ddp_model, state]):`; if a peer died or is stuck, "
                    "its own log says why")


def step_proof(step: int, scale=None, nonfinite: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """A rank's proof elements, on ``device``: ``step``, log2 of ``scale`` (float or tensor), ``nonfinite`` (0/1)."""
    device = torch.device("cpu") if device is None else device
    limbs = ((step >> 0) & 63, (step >> 6) & 63, (step >> 12) & 63)  # _LIMBS of them
    counters = torch.tensor(limbs + (limbs[0] ** 2, limbs[1] ** 2, limbs[2] ** 2, float(step)), dtype=torch.float32,
                            device=device)
    if isinstance(scale, torch.Tensor):
        log_scale = torch.round(torch.log2(scale.detach().reshape(1).to(device=device, dtype=torch.float32)))
    else:
        log_scale = torch.tensor([float(round(math.log2(scale))) if scale else 0.0], dtype=torch.float32,
                                 device=device)
    flag = torch.zeros(1, dtype=torch.float32, device=device) if nonfinite is None else nonfinite.to(device).reshape(1)
    return torch.cat([counters, log_scale, log_scale * log_scale, flag])


def check_step_proof(sums: Sequence[float], step: int, size: int, rank: int, what: str) -> None:
    """DivergenceError (on every rank alike) if the ranks' summed proofs ``sums`` show different steps."""
    if size == 1 or all(size * sums[_LIMBS + i] == sums[i] ** 2 for i in range(_LIMBS)):  # (limbs, squares)
        return
    total = sums[2 * _LIMBS]
    others = f"the other rank is at step {int(round(total - step))}" if size == 2 else \
        f"the {size} ranks' steps add up to {int(round(total))} (mean {total / size:.2f})"
    raise DivergenceError(f"{what}: the ranks are at different optimizer steps: this rank ({rank}) is at step "
                          f"{step}, {others}; {LIKELY_CAUSES}")


def _norms_not_finite(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per gradient, True where its L2 norm is not finite: one fused ``_foreach_norm`` per (device, dtype)."""
    groups: Dict[tuple, List[int]] = defaultdict(list)
    for i, g in enumerate(grads):
        groups[(g.device, g.dtype, g.layout)].append(i)
    out: List[Optional[torch.Tensor]] = [None] * len(grads)
    for (_, dtype, layout), members in groups.items():
        same = grads if len(groups) == 1 else [grads[i] for i in members]
        if layout != torch.strided:  # nn.Embedding(sparse=True): the stored values (implicit zeros are finite)
            same = [g._values().reshape(-1) if layout == torch.sparse_coo else g.values().reshape(-1) for g in same]
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
        bad = ~torch.isfinite(torch.stack(torch._foreach_norm(same, 2, dtype=wide)))
        if len(groups) == 1:
            return bad
        for i, b in zip(members, bad.to(grads[0].device)):
            out[i] = b
    return torch.stack(out)


class NonfiniteGuard:
    """The ``nonfinite`` check, without stalling a GPU: the first bad step per parameter, kept on the device and
    read at the next sync (in its proof: all ranks raise together) or checkpoint.  ``"skip"`` reads it per step."""

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.first: Optional[torch.Tensor] = None  # int64 per parameter: first bad step, -1 if none
        self.index: Dict[Tuple[int, ...], torch.Tensor] = {}  # positions -> on the device, made once per set

    def observe(self, named: Sequence[Tuple[int, Optional[torch.Tensor]]], step: int, record: bool = True):
        """Check ``(position, gradient)`` pairs (``record``: keep the first bad step); bad flags, or None."""
        positions, grads = [], []
        for i, g in named:
            if g is not None:
                positions.append(i)
                grads.append(g)
        if not grads:
            return None
        device = grads[0].device
        if self.first is None or self.first.device != device:
            self.first = self.first.to(device) if self.first is not None else torch.full(
                (len(self.names),), -1, dtype=torch.int64, device=device)
        bad = _norms_not_finite(grads)
        if len(grads) != len(self.names):
            flags = torch.zeros(len(self.names), dtype=torch.bool, device=device)
            key = tuple(positions)
            if key not in self.index or self.index[key].device != device:
                self.index[key] = torch.tensor(key, dtype=torch.int64, device=device)
            flags[self.index[key]] = bad
            bad = flags
        if record:
            self.first = torch.where(bad & (self.first < 0), step, self.first)
        return bad

    def extend(self, names: Sequence[str]) -> None:
        """Parameters that joined the sync: recorded from now on."""
        self.names += list(names)
        self.index.clear()
        if self.first is not None:
            self.first = torch.cat([self.first, self.first.new_full((len(names),), -1)])

    def clear(self) -> None:
        """Forget what was seen (a checkpoint was loaded: its weights were written only when finite)."""
        if self.first is not None:
            self.first.fill_(-1)

    def indicator(self, device) -> torch.Tensor:
        """1.0 if a bad gradient was seen since the record was cleared, else 0.0 (float32, on ``device``)."""
        if self.first is None:
            return torch.zeros(1, dtype=torch.float32, device=device)
        return (self.first >= 0).any().to(device=device, dtype=torch.float32).reshape(1)

    def seen(self) -> Optional[Tuple[int, List[str]]]:
        """(first bad step, the parameters' names) if any was seen, else None.  Host read."""
        return first_bad(self.first, self.names)

    def message(self, rank: int) -> str:
        return nonfinite_message(self.seen(), rank)


class SyncContext:
    """What a sync needs from its state, and nothing more; handed to an algorithm's sync code.  ``step``, ``syncs``,
    ``skipped_steps``, ``sync_steps``: the counters; ``in_sync``: the step after which the ranks last agreed."""

    def __init__(self, comm, name: str, optimizer, guard, amp, config, tensors_changed, identical_named):
        self.comm, self.name, self.optimizer, self.guard, self.amp = comm, name, optimizer, guard, amp
        self.check_every = config.check_every
        self.engine_refresh, self.identical_named = tensors_changed, identical_named
        self.step = self.syncs = self.skipped_steps = 0
        self.sync_steps: List[int] = []
        self.in_sync: Optional[int] = None
        self.end = None  # a state that runs apart: the record its end-of-run check reads (step, in_sync)
        self.refresh = lambda: []  # parameters that joined since, taken in (set by the StepAlignment)
        self.phases = PhaseClock()  # where this rank's steps spend their time (state.report()["phases"])

    def lr(self) -> float:
        """The lr a sync rule reads: the first param group's ``scheduled_lr`` (an lr wrapper's) or ``lr``."""
        group = self.optimizer.param_groups[0]
        return float(group.get("scheduled_lr", group["lr"]))

    def proof(self, within=None) -> torch.Tensor:
        """This rank's step proof (on the synced tensors' device) for a sync's payload.  ``within``: the replica
        group of a sync over one rank of each; the NaN/Inf slot then counts the group's ranks (a 4-byte allgather
        in it: the path a sync takes already), so that the sync's sum counts the world's and all ranks raise."""
        # the scale this rank's scaler holds after this step's update(): halved where this step overflowed here (a
        # sync step's own overflow parts the scales only after the sync, just before the next averaging step)
        amp, scaler = self.amp, self.amp.scaler
        scale = scaler._scale if scaler is not None and scaler._scale is not None else amp.last_scale
        if scale is not None and amp.overflowed:
            scale = scale * (scaler.get_backoff_factor() if scaler is not None else 0.5)
        flag = self.guard.indicator(self.comm.device)
        if within is not None:
            flag = sum(self.comm.allgather(flag, group=within, tag="check", metered=False))
        return step_proof(self.step, scale, flag, self.comm.device)

    def check(self, mean: torch.Tensor, group, tag: str, step: Optional[int] = None) -> None:
        """After a sync: the ranks' mean proof (made at ``step``, default now) shows one step everywhere and no
        NaN/Inf gradient anywhere, else the same error on every rank; GradScaler scales that parted made equal."""
        size = self.comm.size if group is None else group.size
        step = self.step if step is None else step
        sums = torch.round(mean.double() * size).tolist()  # the sync's one host read of its proof
        check_step_proof(sums, step, size, self.comm.rank, f"{self.name} {tag} at step {step}")
        if sums[_NONFINITE]:  # (the world's count: a sync over a part of it made its proofs ``within``)
            where = tag if step == self.step else f"{tag} sent after optimizer step {step}, landed"
            self.raise_nonfinite(int(sums[_NONFINITE]), f"{where} after optimizer step {self.step}")
        if size > 1 and size * sums[_SCALE + 1] != sums[_SCALE] ** 2:
            self.amp.equalize(self.comm, group, step)

    def raise_nonfinite(self, ranks: Optional[int], where: str) -> None:
        """NonFiniteError: ``ranks`` of the world saw a NaN/Inf gradient (None: this rank, no count taken)."""
        raise nonfinite_error(self.name, ranks, self.comm.size, where, self.guard.message(self.comm.rank))

    def average(self, tensors: Sequence[torch.Tensor], group=None, tag: str = "sync", within=None) -> None:
        """Average ``tensors`` in place over ``group`` (default: the world), the step proof (:meth:`proof`) along."""
        with self.failures(), self.phases.phase("exchange"):
            proof = self.proof(within)
            average_(self.comm, tensors, group=group, tag=tag, rider=proof)
        self.check(proof, group, tag)

    @contextlib.contextmanager
    def failures(self):
        """A context in which a failed or timed-out collective names the step and the usual causes."""
        try:
            yield
        except CollectiveError as exc:
            raise CollectiveError(f"{exc} [at optimizer step {self.step}; {_COLLECTIVE_HINT}]") from None

    def rounding_seed(self) -> int:
        """Stochastic rounding's seed: a function of the rank and the step only (a resumed run rounds alike)."""
        return (self.step * 1_000_003 + self.comm.rank) % (2 ** 61)

    def changed(self) -> None:
        """The synced tensors changed outside an optimizer step (a sync, a re-basis): let the engine refresh."""
        if self.engine_refresh is not None:
            self.engine_refresh()

    def synced(self, group=None, complete: bool = True) -> None:
        """Count a sync (``complete``: all ranks hold the same weights); every ``check_every``-th, prove it."""
        self.changed()
        self.syncs += 1
        self.sync_steps.append(self.step)
        if complete:
            self.in_sync = self.step
        if self.check_every and self.syncs % self.check_every == 0:
            verify_identical(self.comm, self.identical_named(), f"after {self.name} sync {self.syncs} "
                             f"(step {self.step})", group=group)


class StepAlignment:
    """The optimizer step hooks of one state (its ``before_step`` / ``after_step`` / ``reduce_gradients``), with its
    :class:`SyncContext` and :class:`~.parameters.ParameterSet`.  ``uncounted``: the next optimizer step is no
    training step (Horovod's state broadcast); ``outside``: inside :meth:`outside_training`."""

    def __init__(self, state, ctx: SyncContext, params, amp):
        self.state, self.ctx, self.params, self.amp = state, ctx, params, amp
        self.guard = ctx.guard
        self.handles: list = []
        self.reduced: set = set()  # ids of the parameters the engine handed over this step (state.reduce_bucket)
        self.uncounted, self.outside, self.joined = False, 0, False
        self.join_config = None  # torch's Join context, set through the state's ``_join_config``
        self.log_every = state.config.log_every
        self.skip = state.config.nonfinite == "skip"
        ctx.refresh = self.new_parameters

    scaler = property(lambda self: self.amp.scaler, lambda self, v: setattr(self.amp, "scaler", v),
                      doc="The torch.amp.GradScaler whose scale the syncs keep equal (state.use_scaler), or None.")

    def hook(self, optimizers) -> None:
        """Register the step hooks on ``optimizers`` (in the order the loop steps them)."""
        self.amp.take_over(optimizers)
        first, last = optimizers[0], optimizers[-1]
        for opt in optimizers:
            self.handles.append(opt.register_step_pre_hook(lambda o, args, kwargs: self.pre_step(o, o is first)))
            if opt is last:
                self.handles.append(opt.register_step_post_hook(lambda o, args, kwargs: self.end_step()))

    def release(self) -> None:
        """Unregister the step hooks and hand AMP scaling back."""
        while self.handles:
            self.handles.pop().remove()
        self.amp.release()

    @contextlib.contextmanager
    def outside_training(self):
        """Optimizer steps inside are no training steps (torch's ``set_optimizer_state_dict`` takes one)."""
        self.outside += 1
        try:
            yield
        finally:
            self.outside -= 1

    def counts_this_step(self) -> bool:
        """Whether the optimizer step just taken is a training step (the ``uncounted`` mark is used up here)."""
        counts = not (self.outside or self.uncounted)
        self.uncounted = self.uncounted and bool(self.outside)
        return counts

    def pre_step(self, optimizer, starts: bool) -> None:
        """Before an optimizer's step: a GradScaler's unscale or drop, the strays, the NaN guard (a dropped update
        counts as a skipped step); the first optimizer's also starts the iteration."""
        if self.uncounted or self.outside:
            return
        state, ctx = self.state, self.ctx
        with ctx.phases.hook(before_step=True) if starts else contextlib.nullcontext():
            params = []
            for group in optimizer.param_groups:
                params += group["params"]
            dropped = checked = False
            if getattr(optimizer, "found_inf", None) is not None or getattr(optimizer, "grad_scale", None) is not None:
                dropped, checked = self.amp.step(optimizer, params)  # a GradScaler checked these: it decides
            if starts and state.reduces_gradients and self.reduced:
                # a rank whose update is dropped (an overflow in a local step) still joins the strays'
                # collectives, contributing nothing, as a joined rank does: the others' reduction must find it
                self.reduce_strays(shadow=dropped)
            if not checked and self.guard_step(params):
                dropped = True
            ctx.skipped_steps += dropped
            if starts:
                if self.join_config is not None and self.join_config.enable:
                    ctx.comm.notify_join(state)
                state.before_step()

    def guard_step(self, params) -> bool:
        """The ``nonfinite`` policy on these gradients (``"skip"``: one host read, and True if dropped)."""
        own, named, ps, grads = set(map(id, params)), self.params.named, self.params, []
        for i, (_, p) in enumerate(named):
            if id(ps.optimized(p) if ps.slices else p) in own:
                grads.append((i, ps.gradient(p) if ps.slices else p.grad))
        bad = self.guard.observe(grads, self.ctx.step, record=not self.skip)
        if not self.skip or bad is None or not bool(bad.any()):
            return False
        for i, _ in grads:
            ps.optimized(named[i][1]).grad = None  # torch's optimizers then leave p, its momentum and decay alone
        return True

    def end_step(self) -> None:
        """After the last optimizer's step: count it, the algorithm's ``after_step``, where the run stands."""
        if not self.counts_this_step():
            return
        ctx = self.ctx
        ctx.step += 1
        with ctx.phases.hook(before_step=False):
            self.state.after_step()
        if ctx.end is not None:  # (the run's end record: where it stands after a step counted in this process)
            ctx.end.step, ctx.end.in_sync = ctx.step, ctx.in_sync
        if self.log_every and ctx.step % self.log_every == 0 and ctx.comm.rank == 0:
            self.state.log()

    def new_parameters(self) -> List[str]:
        """Parameters that became trainable or joined an optimizer since, taken in by the state; their names."""
        ps = self.params
        for p in ps.module.parameters() if ps.module is not None and not ps.names_given else ():
            if p.requires_grad and id(p) not in ps.ids:
                return self.state.refresh_parameters()
        for opt in ps.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in ps.ids and id(p) not in ps.flat_ids:
                        return self.state.refresh_parameters()
        return []

    def reduce_strays(self, shadow: bool = False) -> None:
        """Reduce, as ``reduce_gradients`` would, the gradients of trainable parameters the engine did not hand over
        (DDP builds its buckets once: a layer unfrozen later is never in one); a missing one counts as zero,
        and stays missing if no rank had it (a flag allreduce and a host read per step while strays exist)."""
        ps, reduced, strays = self.params, self.reduced, []
        self.reduced = set()
        handed = ps.module is None or ps.names_given  # every parameter a step may change: the tensors handed over
        own = ps.tensors if handed else ps.module.parameters()  # (all) or the module's trainable ones, and the
        seen = set(ps.flat_ids) if handed else set()  # optimizers' (a flat one is covered by its views)
        for p in own:
            if (handed or p.requires_grad) and id(p) not in seen:
                seen.add(id(p))
                strays += [] if id(p) in reduced else [p]
        for opt in ps.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        strays += [] if id(p) in reduced else [p]
        if not strays:
            return
        had = torch.tensor([0.0 if shadow or p.grad is None else 1.0 for p in strays], device=self.ctx.comm.device)
        missing = [] if shadow else [p for p in strays if p.grad is None]
        for p in missing:
            p.grad = torch.zeros_like(p)
        grads = [torch.zeros_like(p) for p in strays] if shadow else [p.grad for p in strays]
        kinds: Dict[tuple, List[int]] = defaultdict(list)
        for i, g in enumerate(grads):
            kinds[(g.dtype, g.device)].append(i)
        with self.ctx.failures():
            for same in kinds.values():
                self.state.reduce_gradients([grads[i] for i in same], [strays[i] for i in same]).wait()
            self.ctx.comm.allreduce([had], op="max", tag="strays", metered=False)  # did any rank have one?
        anyone = dict(zip(map(id, strays), had.tolist()))
        for p in missing:
            if not anyone[id(p)]:
                p.grad = None

    def agree_on_period(self, local: Optional[int]) -> Optional[int]:
        """The max over ranks inside a Join (a joined rank sends 0) or where ranks' lr may differ, else ``local``."""
        comm = self.ctx.comm
        joining = self.join_config is not None and self.join_config.enable
        if not (joining or self.state.engine.lr_may_differ) or comm.size == 1:
            return local
        value = torch.tensor([0.0 if self.joined or local is None else float(local)], dtype=torch.float64,
                             device=comm.device)
        comm.allreduce([value], op="max", tag="join", metered=False)
        return int(value.item())

    def refuse_everywhere(self, where: str) -> None:
        """NonFiniteError on every rank if any rank saw a NaN/Inf gradient (one flag allreduce, a host read)."""
        ranks = count_everywhere(self.ctx.comm, self.guard.indicator(self.ctx.comm.device))
        if ranks:
            self.ctx.raise_nonfinite(ranks, where)
