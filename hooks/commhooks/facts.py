"""Engine facts: what the engine and the launcher know and an algorithm needs (:class:`EngineFacts`), and
where each fact comes from.

An algorithm needs a few facts only the engine and the launcher know (the unwrapped module, whether DDP
re-broadcasts buffers on every forward, ranks per node).  Algorithm code may not find them out itself (it
imports no engine and reads no environment variable), so they are handed over as ``engine=``:

* every adapter builds its engine's facts with :func:`for_model`, adds what its engine says, and passes them:
  :func:`commhooks.ddp.register` (and the Accelerate and Trainer integrations through it), Lightning's
  callback (Lightning drives the steps), Horovod (ranks per node from ``hvd.local_size()``), DeepSpeed (the
  fp32 masters, who drives the steps, the refresh of the low-precision weights);
* a state built by hand, ``commhooks.QSRState(optimizer, model=ddp_model, ...)`` then
  ``ddp_model.register_comm_hook(state, commhooks.qsr_hook)`` (the README's second way), passes none.  The base
  class then calls :func:`for_model` on the model it was given.

Why this, and not a list of providers that the adapters fill when they are imported: with such a registry the
facts depended on which modules happened to be imported before the state was built, and the algorithms layer
held global state that the adapters wrote into.  Here where each fact comes from is written once, in
:func:`for_model`, and read when needed: DDP's facts from a ``DistributedDataParallel`` model (its buffer
flag, :func:`buffers_broadcast_each_forward`, and its Join, :func:`include_in_join`, both here), ranks per node
from the launcher's environment (:mod:`commhooks.launch`).  The facts are needed while the state is built (the
handshake checks the parameter names, the replica groups follow the ranks per node), so they cannot wait for
the hook's registration.

Where this module sits: below the algorithms, whose base class imports it for a state built by hand, and
above the launcher, the one commhooks module it imports (besides torch).  So the DDP fact readers live here,
not in :mod:`commhooks.ddp` (which sits above the algorithms and re-exports them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence

import torch

from .launch import LaunchError, discover


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the engine knows and the algorithm needs, handed over by the adapter.

    * ``module``: the user's model, unwrapped (its parameters and buffers are
      what a sync averages; its parameter names are what config patterns match).
    * ``buffers_synced_each_forward``: the engine re-broadcasts buffers from
      rank 0 on every forward (DDP's ``broadcast_buffers``), so averaging
      them is moot.
    * ``local_world_size``: ranks per node, from the launcher (``None``:
      unknown, the algorithm treats the world as one node).
    * ``drives_steps``: the engine calls :meth:`AlgorithmState.begin_step` /
      :meth:`~AlgorithmState.end_step` itself, once per optimizer step,
      instead of the optimizer's step hooks (DeepSpeed's mixed-precision and
      ZeRO wrappers call the inner optimizer once per param group, or not at
      all on an fp16 overflow).
    * ``replica_data_parallel``: the engine runs its own data parallelism
      inside each replica group (gradients averaged every step, ZeRO shards
      the optimizer inside the group); the tensors the state was given are
      this rank's *shard* of the group's replica, so a sync averages them
      with the same shard of the other groups (rank i of every group).
    * ``lr_may_differ``: the engine may skip an lr-scheduler step on some
      ranks only (DeepSpeed's fp16 loss scaler on an overflow), so
      lr-dependent periods are agreed across ranks once per round.
    * ``tensors_changed``: called right after the state changed the synced
      tensors outside an optimizer step (a sync, a re-basis); DeepSpeed
      refreshes the low-precision weights from the fp32 masters there.
    * ``master_slices``: the tensors handed over are views into the
      optimizer's parameters, and this maps each view to its stretch
      ``(parameter, start, end)`` of that parameter's local elements, where
      its optimizer state and gradient are.  DeepSpeed's fused optimizers
      keep one flat fp32 master per group (per-layer algorithms see each
      layer's matrix through the views); FSDP2's parameters are DTensors,
      and a view is this rank's local shard of one (a sync computes on local
      tensors only: math on a DTensor runs collectives in the shard group).
    * ``start_at_first_step``: the script may set the weights after the
      state is built (Horovod's own order: ``DistributedOptimizer``, then
      ``broadcast_parameters``), so the check that every rank starts from
      the same weights (and the set-up that reads them) waits until the
      engine calls :meth:`AlgorithmState.start_training`, where the first
      step begins; checked at construction, it would find the ranks apart
      and broadcast what the next line broadcasts anyway.
    * ``attach``: called with the state once it is built, so the engine's own
      idioms include it, however the state was built (DDP: ``with
      ddp_model.join():`` takes the state in, as ``Join([ddp_model, state])``).
    """

    module: Optional[torch.nn.Module] = None
    buffers_synced_each_forward: bool = False
    local_world_size: Optional[int] = None
    drives_steps: bool = False
    replica_data_parallel: bool = False
    lr_may_differ: bool = False
    tensors_changed: Optional[Callable[[], None]] = None
    master_slices: Optional[dict] = None  # id(view) -> (optimizer parameter, start, end): DeepSpeed's fused
    # fp16/bf16 master, FSDP2's DTensor (whose local part the view is)
    attach: Optional[Callable[[object], None]] = None
    start_at_first_step: bool = False


def launcher_local_world_size() -> Optional[int]:
    """Ranks per node as the launcher's environment says (None: no launcher found, or its variables disagree;
    the algorithm then treats the world as one node)."""
    try:
        placement = discover()
    except LaunchError:
        return None
    return None if placement is None else placement.local_world_size


def for_model(model, **known) -> EngineFacts:
    """The facts of ``model`` (a ``DistributedDataParallel`` model, a plain module or None) and the launcher,
    with ``known``: the fields the caller's engine states itself (they win; a ``local_world_size`` given there
    spares the look at the environment)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        found = {"module": model.module, "buffers_synced_each_forward": buffers_broadcast_each_forward(model),
                 "attach": functools.partial(include_in_join, model)}
    else:
        found = {"module": model}
    if "local_world_size" not in known:
        found["local_world_size"] = launcher_local_world_size()
    return EngineFacts(**{**found, **known})


# --------------------------------------------------------------------------
# the facts of a DDP model
# --------------------------------------------------------------------------


def buffers_broadcast_each_forward(model) -> bool:
    """Whether a DDP model re-broadcasts buffers on every forward (both torch spellings)."""
    flag = getattr(model, "forward_sync_buffers", None)
    if flag is None:
        flag = getattr(model, "broadcast_buffers", False)
    return bool(flag)


def include_in_join(ddp_model, state) -> None:
    """Make PyTorch's own idiom ``with ddp_model.join():`` include the state (as ``Join([ddp_model, state])``),
    however the state was built (the engine facts of a DDP model call it once the state is built: through
    :func:`commhooks.ddp.register`, and on the two-line route ``QSRState(optimizer, model=ddp_model)`` +
    ``ddp_model.register_comm_hook(state, commhooks.comm_hook)``):
    a rank out of data then shadows the syncs too, instead of leaving the others' collectives unpaired.

    And end a Join context with the state first: DDP's own Join post-hook broadcasts the last joiner's model to
    every rank (DDP's ranks agree anyway).  Between syncs each rank's model is its own, so that broadcast would
    throw away the other ranks' progress since the last sync, at every per-epoch ``with ddp_model.join():``.
    The state ends the context first (a sync if a rank ran out of data early); DDP's broadcast then runs only
    when the ranks agree (a no-op), and is skipped while a round is open."""
    from torch.distributed.algorithms.join import Join

    def join(divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False):
        return Join([ddp_model, state], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    ddp_model.join = join  # an instance attribute: this model only
    ddp_hook = ddp_model.join_hook
    ddp_model.join_hook = lambda **kwargs: _StateEndsJoinFirst(ddp_hook(**kwargs), state)


class _StateEndsJoinFirst:
    """DDP's join hook, with the state's end of the context run before DDP's final broadcast."""

    def __init__(self, ddp_hook, state):
        self.ddp_hook, self.state = ddp_hook, state

    def main_hook(self) -> None:
        self.ddp_hook.main_hook()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.state.end_join()
        self.state.join_ended_by_engine = True  # the state's own post-hook, next, has nothing left to do
        if self.state.in_sync_at() == self.state.step:  # the same on every rank: all broadcast, or none
            self.ddp_hook.post_hook(is_last_joiner)


def row_shard_numel(shapes: Sequence[Sequence[int]], count: int, member: int) -> int:
    """An engine fact the traffic declarations need (FSDP2's ``Shard(0)``): elements of the ``member``-th of ``count`` row shards of tensors of ``shapes``: each tensor's dim 0 cut as
    ``torch.chunk`` cuts it (chunks of ``ceil(rows / count)``, the last ones shorter or empty), as FSDP2 shards."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        chunk = math.ceil(rows / count)
        total += max(0, min(chunk, rows - member * chunk)) * (math.prod(shape[1:]) if shape else 1)
    return total
