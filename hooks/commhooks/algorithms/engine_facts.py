"""What the engine knows and an algorithm needs (:class:`EngineFacts`), handed over by the adapters."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch


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
    * ``master_slices``: the tensors handed over are per-parameter views into
      the engine's flat fp32 master (DeepSpeed's fused optimizers keep one per
      group), so per-layer algorithms see each layer's matrix; this maps each
      view to its stretch of the flat parameter, whose optimizer state is one.
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
    master_slices: Optional[dict] = None  # the tensors handed over are views into flat optimizer parameters:
    # id(view) -> (flat parameter, start, end) (DeepSpeed's fused fp16/bf16 master), for per-tensor optimizer state
    attach: Optional[Callable[[object], None]] = None


def _facts_of_hand_built_state(model) -> EngineFacts:
    """The facts for a state built by hand (no ``engine=``: ``QSRState(optimizer, model=ddp_model)``), from
    :func:`commhooks.facts.for_model`, the adapters' module that knows where each fact comes from.  Imported
    here, at the call: this layer names no engine, reads no environment and holds no registry."""
    from ..facts import for_model

    return for_model(model)
