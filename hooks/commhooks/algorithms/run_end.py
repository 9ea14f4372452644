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

And two warnings, once per state, on every rank: a run with no known end
(:func:`warn_open_end`), and trainable parameters no optimizer given to the
state steps (:func:`warn_unoptimized`).

Functions of the state (as :func:`~.parameters.reduce_strays`), called by
its thin methods of the same names; subclasses extend ``final_sync`` (land
the syncs in flight first) and :func:`end_join` calls theirs.
"""

from __future__ import annotations

import warnings
from typing import Sequence, Tuple

import torch

from .helpers import user_stacklevel


def final_sync(state) -> None:
    """Sync if the last round was left open (the end of a run: ``finish()``, a Join with uneven inputs)."""
    state.joined = False
    if state.step and state.in_sync_at() != state.step:
        state.sync()


def shadow_step(state) -> None:
    """One iteration of the others, on a rank that has run out of data: agree on periods, count the step, take
    part in its sync or phase switch (and, where the state reduces gradients, in the reduction of gradients the
    engine did not hand over, with zeros).  The optimizer makes no update."""
    state.joined = True
    if state.reduces_gradients:
        state._reduce_strays(shadow=True)
    state.before_step()
    state.end_step()


def end_join(state) -> None:
    """At the end of a Join context (every rank calls it): if some rank ran out of data early (uneven inputs, a
    real end), sync the open round so every rank leaves with the same model.  If every rank stepped to the end
    together (a per-epoch ``with ddp_model.join():`` on even shards) the schedule goes on untouched: one flag
    allreduce, no sync.  The run's end is ``with state:`` / ``total_steps``."""
    flag = torch.tensor([1.0 if state.joined else 0.0], device=state.device)
    if state.comm.size > 1:
        state.comm.allreduce([flag], op="max", tag="join", metered=False)
    state.joined = False
    if flag.item():
        state.final_sync()


def warn_open_end(state) -> None:
    """Once, at the first step: a run whose ranks differ between syncs, with no known end and no ``with
    state:``, may end between two syncs, with different models on the ranks."""
    state._warned_end = True
    if not state.runs_apart or state._in_context or "total_steps" not in type(state.config).model_fields:
        return
    if state.config.total_steps is not None:
        return
    warnings.warn(
        f"{state.display_name}: total_steps is not set, and between syncs each rank's model is its own: a run that "
        "ends between two syncs ends with different models on the ranks. Set total_steps (the last period then "
        "ends with a sync; commhooks train fills it from --steps, DeepSpeed from its scheduler's "
        "total_num_steps), or wrap the loop in `with state:` (its exit syncs if the last step did not; "
        "state.finish() after the loop does the same)", stacklevel=user_stacklevel())


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
