"""The state's collaborator that keeps every rank on one schedule (the mechanisms are :mod:`.alignment`'s).

It owns the optimizer step hooks (the first optimizer's pre-hook starts an
iteration, the last one's post-hook ends it: :meth:`StepAlignment.hook`), and
what a state needs to prove, at each sync, that the ranks are where they
should be, and to act when they are not:

* the GradScaler takeover (the scaler always calls ``optimizer.step()``; an
  overflowed step is dropped here and still counts) and the scaler whose
  scale the syncs keep equal (``use_scaler``);
* the NaN/Inf guard (``nonfinite``): recorded on the device, read at the next
  sync or checkpoint, so no host stall per step under ``"raise"``;
* the step proof riding in each sync's payload, and its check afterwards
  (DivergenceError / NonFiniteError on every rank alike);
* the lr-dependent period every rank uses inside a Join or when an engine may
  leave some ranks' lr behind.

The state offers algorithms ``step_proof`` and ``check_proof`` (beside its
own ``collective_context``, ``synced`` ...), users ``use_scaler``, engines
``not_a_training_step``; everything else is reached as ``state.alignment``.

A run that ends synced.  A local method's ranks hold different models between
syncs (it declares ``runs_apart``), so a run that stops between two of them
(the data ran out, a loop ended early, one rank had fewer batches) would end
with different models, silently.  Four ways close the last round, all ending
in :meth:`~.base.AlgorithmState.final_sync` (which subclasses extend: land the syncs in flight
first): ``total_steps`` (the schedule ends its last period with a sync);
``with state:`` around the loop, or ``state.finish()`` after it; the end of a
``torch.distributed.algorithms.join.Join`` context with uneven inputs
(:meth:`StepAlignment.end_join`; ranks out of data shadow the others' steps meanwhile,
:meth:`StepAlignment.shadow_step`); frameworks' end-of-fit callbacks, which call
``finish()``.  A per-epoch ``with ddp_model.join():`` on even shards ends
with every rank stepping together: one flag allreduce, no sync.

And the end-of-run check, once per state, on every rank, for a state whose
ranks differ between syncs: a run that really ended between two syncs (each
rank then holds its own model) is warned about when the state is dropped or
the process exits (:func:`watch_the_end`), so a run closed by ``finish()``,
``with state:`` or ``total_steps`` sees none.
"""

from __future__ import annotations

import contextlib

import dataclasses
import sys
import warnings
import weakref
from typing import List, Optional, Sequence

import torch

from . import alignment
from .consistency import NonFiniteError, NonfiniteGuard, anywhere, skip_gradients
from .parameters import reduce_strays, user_stacklevel


class StepAlignment:
    """Step hooks, scaler, NaN guard, step proofs and period agreement of one :class:`~.base.AlgorithmState`."""

    def __init__(self, state, names: Sequence[str]):
        self.state = state
        self.guard = NonfiniteGuard(list(names))
        self.scaler = None  # a torch.amp.GradScaler whose scale the syncs keep equal (use_scaler)
        self.last_scale: Optional[torch.Tensor] = None  # the scale a GradScaler handed to the last step (device)
        self.amp_owned: List[torch.optim.Optimizer] = []
        self.handles: list = []  # the optimizer step hooks (hook)
        self.uncounted = False  # the next optimizer step is no training step (state.not_a_training_step)
        self.outside = 0  # > 0: inside outside_training(), no optimizer step is a training step
        self._warned_scales = False

    # ------------------------------------------------------------ each step
    def hook(self, optimizers) -> None:
        """Register the step hooks on ``optimizers`` (in the order the loop steps them); GradScaler then calls
        their ``step()`` always and the state unscales or drops (fused optimizers keep their own handling)."""
        self.amp_owned = [opt for opt in optimizers if alignment.take_over_amp_scaling(opt)]
        first, last = optimizers[0], optimizers[-1]
        for opt in optimizers:
            self.handles.append(opt.register_step_pre_hook(lambda o, args, kwargs: self.pre_step(o, o is first)))
            if opt is last:
                self.handles.append(opt.register_step_post_hook(lambda o, args, kwargs: self.state.end_step()))

    def counts_this_step(self) -> bool:
        """Whether the optimizer step just taken is a training step: not one inside :meth:`outside_training`, nor
        the one ``state.not_a_training_step()`` announced (that mark is used up here)."""
        if self.outside:
            return False
        if self.uncounted:
            self.uncounted = False
            return False
        return True

    @contextlib.contextmanager
    def outside_training(self):
        """A context in which optimizer steps are no training steps: not counted, nothing checked or sent.  For
        library code that steps the optimizer to build its state (torch's ``get_optimizer_state_dict`` and
        ``set_optimizer_state_dict`` take a zero-lr step on an optimizer without state), whether it steps or
        not."""
        self.outside += 1
        try:
            yield
        finally:
            self.outside -= 1

    def release(self) -> None:
        """Unregister the step hooks and hand AMP scaling back."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for opt in self.amp_owned:
            alignment.release_amp_scaling(opt)
        self.amp_owned = []

    def pre_step(self, optimizer, starts: bool) -> None:
        """Before an optimizer's step: a GradScaler's unscale/skip, the strays, the NaN guard (a dropped update
        counts as a skipped step); the first optimizer's also starts the iteration (``state.begin_step``)."""
        state = self.state
        if self.uncounted or self.outside:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        dropped, checked = self.scaler_step(optimizer, params)  # a GradScaler checked these: it decides
        if starts and state.reduces_gradients:
            if dropped:  # no update this step (every rank's overflow check agrees after the engine's reduction)
                state._reduced = set()
            else:
                reduce_strays(state)
        if not checked and self.guard_step(params):
            dropped = True
        if dropped:
            state.skipped_steps += 1
        if starts:
            state.begin_step()

    def scaler_step(self, optimizer, params) -> tuple:
        """What a GradScaler handed this step: ``(dropped, checked)``: the update was dropped on an overflow
        (one host read, as torch's own ``GradScaler.step`` makes); the scaler checked these gradients (then it,
        not the guard, decides)."""
        grad_scale, found_inf = alignment.scaler_inputs(optimizer)
        if grad_scale is not None:
            self.last_scale = grad_scale.detach()  # a fresh tensor each step (scale * 1): no copy, no host read
        if found_inf is None:
            return False, False
        owned = any(optimizer is o for o in self.amp_owned)
        return owned and alignment.apply_scaler(optimizer, params, grad_scale, found_inf), True

    def guard_step(self, params: Sequence[torch.Tensor]) -> bool:
        """The ``nonfinite`` policy on these gradients: ``"raise"`` records on the device (read at the next sync,
        no host stall); ``"skip"`` drops the update now (one host read per step).  True if dropped."""
        state, covered = self.state, self.state.parameter_set
        grads = covered.step_gradients(params)
        skip = state.config.nonfinite == "skip"
        bad = self.guard.observe(grads, state.step, record=not skip)
        named = state.named_params
        return skip and skip_gradients([(named[i][0], covered.optimized(named[i][1])) for i, _ in grads], bad)

    # ------------------------------------------------------------ each sync
    def proof(self) -> torch.Tensor:
        """This rank's step proof (GradScaler scale, NaN/Inf record), on the synced tensors' device."""
        state = self.state
        scale = self.scaler._scale if self.scaler is not None and self.scaler._scale is not None else self.last_scale
        return alignment.step_proof(state.step, scale, self.guard.indicator(state.device), state.device)

    def check(self, mean: torch.Tensor, group, tag: str, step: Optional[int] = None) -> None:
        """After a sync: the same step everywhere (else DivergenceError on every rank), no NaN/Inf gradient on
        any rank (else NonFiniteError on every rank); GradScaler scales that parted made equal."""
        state = self.state
        size = state.comm.size if group is None else group.size
        step = state.step if step is None else step
        sums = alignment.proof_sums(mean, size)  # the sync's one host read of its proof
        alignment.check_step_proof(sums, step, size, state.comm.rank, f"{state.display_name} {tag} at step {step}")
        bad = alignment.nonfinite_ranks(sums)
        if bad:
            self.raise_nonfinite(bad, f"{tag} at step {state.step}")
        if alignment.scales_differ(sums, size):
            self.equalize_scales(group)

    def raise_nonfinite(self, ranks: int, where: str) -> None:
        raise NonFiniteError(
            f"NaN or Inf gradient on {ranks} rank(s) since the last sync, found at the {self.state.display_name} "
            f"{where}: {self.guard.message(self.state.comm.rank)} (nonfinite='raise' checks on the device and reads "
            "the record at each sync and checkpoint; set nonfinite='skip' to skip such steps instead)")

    def refuse_everywhere(self, where: str) -> None:
        """NonFiniteError on every rank if any rank saw a NaN/Inf gradient (one flag allreduce, a host read)."""
        state = self.state
        flag = self.guard.indicator(state.device)
        if state.comm.size > 1:
            state.comm.allreduce([flag], op="sum", tag="check", metered=False)
        ranks = int(flag.item())
        if ranks:
            self.raise_nonfinite(ranks, where)

    def equalize_scales(self, group) -> None:
        """Every rank of ``group`` takes the smallest GradScaler scale (or a warning once, without the scaler)."""
        state = self.state
        if self.scaler is None:
            if state.reduces_gradients and not self._warned_scales:
                self._warned_scales = True
                warnings.warn(
                    f"{state.display_name}: the ranks' GradScaler scales differ (a rank overflowed during local "
                    "steps); the next gradient-averaging steps would average gradients scaled by different factors. "
                    "Pass the scaler: state.use_scaler(scaler) or commhooks.ddp.register(..., scaler=scaler)",
                    stacklevel=user_stacklevel())
            return
        scale = self.scaler._scale  # GradScaler keeps it as a one-element tensor
        lowest = -scale.detach().double().reshape(1).to(state.device)
        state.comm.allreduce([lowest], op="max", group=group, tag="amp-scale", metered=False)
        scale.copy_((-lowest).to(device=scale.device, dtype=scale.dtype).reshape(scale.shape))
        self.scaler._growth_tracker.zero_()  # restart growth from the common scale, as after a backoff

    def shadow_step(self) -> None:
        """One iteration of the others, on a rank that has run out of data: agree on periods, count the step,
        take part in its sync or phase switch (and in the reduction of the strays, with zeros); no update."""
        state = self.state
        state.joined = True
        if state.reduces_gradients:
            reduce_strays(state, shadow=True)
        state.before_step()
        state.end_step()

    def end_join(self) -> None:
        """At the end of a Join context (every rank): sync the open round if some rank ran out of data early."""
        state = self.state
        joined = anywhere(state.comm, state.joined, tag="join")
        state.joined = False
        if joined:
            state.final_sync()
        note_the_end(state)

    def agree_on_period(self, local: Optional[int]) -> Optional[int]:
        """The max over ranks inside a Join context (a joined rank sends 0) or when the engine may leave some
        ranks' lr behind (``lr_may_differ``); otherwise ``local``, no communication."""
        state = self.state
        joining = state._join_config is not None and state._join_config.enable
        if not (joining or state.engine.lr_may_differ) or state.comm.size == 1:
            return local
        value = torch.tensor([0.0 if state.joined or local is None else float(local)], dtype=torch.float64,
                             device=state.device)
        state.comm.allreduce([value], op="max", tag="join", metered=False)
        return int(value.item())


# ------------------------------------------------------------ the run's end


@dataclasses.dataclass
class _OpenEnd:
    """What the end-of-run check knows of a state once the state is gone: its name, its last step, and
    whether every rank held the same model after it (its own ``in_sync_at``, noted after each step and at
    ``finish()``)."""

    name: str
    step: int = 0
    synced: bool = True


def watch_the_end(state) -> None:
    """After each step (only the first does anything), for a state whose ranks differ between syncs: arrange the
    end-of-run check, run when the state is dropped or, at the latest, when the process exits
    (:func:`_warn_if_ended_apart`)."""
    if state._warned_end:
        return
    state._warned_end = True
    if not state.runs_apart:
        return
    state._end = _OpenEnd(state.display_name)
    state._end_check = weakref.finalize(state, _warn_if_ended_apart, state._end, weakref.ref(state))


def note_the_end(state) -> None:
    """After each step and at ``finish()``: where the run stands, for the end-of-run check."""
    if state._end is not None:
        state._end.step = state.step
        state._end.synced = state.in_sync_at() == state.step


def _warn_if_ended_apart(end: _OpenEnd, ref) -> None:
    """The run is over (its state dropped, or the process exiting): warn if its last step left the ranks with
    different models.  Not after an uncaught error: its traceback is the news."""
    state = ref()
    if state is not None:  # the process is exiting with the state alive: ask it
        note_the_end(state)
    if getattr(sys, "last_value", None) is not None or end.step == 0 or end.synced:
        return
    warnings.warn(
        f"{end.name}: the run ended at step {end.step}, between two syncs: each rank holds its own model. Call "
        "state.finish() after the loop (or wrap it in `with state:`), or set total_steps (the last period then "
        "ends with a sync; commhooks train fills it from --steps, DeepSpeed from its scheduler's "
        "total_num_steps)", UserWarning, stacklevel=2)
