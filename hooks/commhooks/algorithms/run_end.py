"""How a run ends with the same model on every rank, for a state whose ranks differ between syncs.

A local method's ranks hold different models between syncs, so a run that
stops between two of them (the data ran out, a loop ended early, one rank had
fewer batches) would end with different models, silently.  Four ways close
the last round, all ending in :func:`final_sync`:

* ``total_steps``: the schedule ends its last period with a sync (the
  algorithm's own business);
* ``with state:`` around the loop, or ``state.finish()`` after it;
* the end of a ``torch.distributed.algorithms.join.Join`` context (uneven
  inputs): :func:`end_join`, while ranks out of data shadow the others'
  steps (:func:`shadow_step`);
* frameworks' end-of-fit callbacks, which call ``finish()``.

And two warnings, once per state, on every rank: a run that really ended
between two syncs (:func:`watch_the_end`: checked when the state is dropped or
the process exits, so a run closed by ``finish()``, ``with state:`` or
``total_steps`` sees none), and trainable parameters no optimizer given to the
state steps (:func:`warn_unoptimized`).

:class:`RunEnd` is a part of :class:`~.base.AlgorithmState` (the context
manager, ``finish``, torch's Joinable protocol); subclasses extend
``final_sync`` (land the syncs in flight first), and :meth:`RunEnd.end_join`
calls theirs.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
import weakref
from typing import Optional, Sequence, Tuple

import torch

from .alignment import ShadowJoinHook
from .parameters import user_stacklevel


class RunEnd:
    """How a run ends synced, and torch's Joinable protocol (:class:`~.base.AlgorithmState` inherits them)."""

    def __enter__(self):
        """``with state:`` around the training loop: its exit ends the run synced (:meth:`finish`)."""
        self._in_context = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._in_context = False
        if exc_type is None:  # after an error the other ranks may not come: no collective then
            self.finish()
        return False

    def finish(self) -> None:
        """End the run with the same model on every rank: land the syncs in flight and, unless the last step
        synced, sync now.  Collective: every rank calls it after its last step (``with state:`` does)."""
        self.final_sync()
        note_the_end(self)

    def final_sync(self) -> None:
        """Sync if the last round was left open (the end of a run: ``finish()``, a Join with uneven inputs)."""
        self.joined = False
        if self.step and self.in_sync_at() != self.step:
            self.sync()

    def in_sync_at(self) -> Optional[int]:
        """The optimizer step right after which every rank last held the same weights (a complete sync);
        ``None`` before the first.  Checkpoints marked ``synced`` and the end of a Join rely on it."""
        return self.sync_steps[-1] if self.sync_steps else None

    def join_hook(self, **kwargs) -> ShadowJoinHook:
        """torch's Joinable protocol: ``with Join([ddp_model, state]):`` lets ranks with fewer batches shadow the
        others."""
        return ShadowJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.comm.world.handle

    def shadow_step(self) -> None:
        """One iteration of the others, on a rank that has run out of data: agree on periods, count the step,
        take part in its sync or phase switch (and, where the state reduces gradients, in the reduction of
        gradients the engine did not hand over, with zeros).  The optimizer makes no update."""
        self.joined = True
        if self.reduces_gradients:
            self._reduce_strays(shadow=True)
        self.before_step()
        self.end_step()

    def end_join(self) -> None:
        """At the end of a Join context (every rank calls it): if some rank ran out of data early (uneven
        inputs, a real end), sync the open round so every rank leaves with the same model.  If every rank
        stepped to the end together (a per-epoch ``with ddp_model.join():`` on even shards) the schedule goes on
        untouched: one flag allreduce, no sync.  The run's end is ``with state:`` / ``total_steps``."""
        flag = torch.tensor([1.0 if self.joined else 0.0], device=self.device)
        if self.comm.size > 1:
            self.comm.allreduce([flag], op="max", tag="join", metered=False)
        self.joined = False
        if flag.item():
            self.final_sync()
        note_the_end(self)


@dataclasses.dataclass
class _OpenEnd:
    """What the end-of-run check knows of a state once the state is gone: its name, its last step, and
    whether every rank held the same model after it (its own ``in_sync_at``, noted after each step and at
    ``finish()``)."""

    name: str
    step: int = 0
    synced: bool = True


def watch_the_end(state) -> None:
    """At the first step, for a state whose ranks differ between syncs: arrange the end-of-run check, run when
    the state is dropped or, at the latest, when the process exits (:func:`_warn_if_ended_apart`)."""
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


def warn_unoptimized(state, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Trainable model parameters in none of the optimizers given: another optimizer that steps them after a
    sync makes the ranks differ again, silently.  A warning on every rank, naming them."""
    missing = state.parameter_set.unoptimized(named)
    if missing:
        warnings.warn(
            f"{state.display_name}: trainable parameters in none of the optimizers given: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''} ({len(missing)}). If another optimizer steps them, its updates "
            "after each sync make the ranks differ: pass every optimizer, in the order the loop steps them "
            "(commhooks.ddp.register(ddp_model, [opt_a, opt_b], config), or optimizer=[opt_a, opt_b])",
            stacklevel=user_stacklevel())
