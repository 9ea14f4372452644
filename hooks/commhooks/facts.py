"""Engine facts: where each :class:`~commhooks.algorithms.engine_facts.EngineFacts` field comes from.

An algorithm needs a few facts only the engine and the launcher know (the unwrapped module, whether DDP
re-broadcasts buffers on every forward, ranks per node).  Algorithm code may not find them out itself (it
imports no engine and reads no environment variable), so they are handed over as ``engine=``:

* every adapter builds its engine's facts with :func:`for_model`, adds what its engine says, and passes them:
  :func:`commhooks.ddp.register` (and the Accelerate and Trainer integrations through it), Lightning's
  callback (Lightning drives the steps), Horovod (ranks per node from ``hvd.local_size()``), DeepSpeed (the
  fp32 masters, who drives the steps, the refresh of the low-precision weights);
* a state built by hand, ``commhooks.QSRState(optimizer, model=ddp_model, ...)`` then
  ``ddp_model.register_comm_hook(state, commhooks.qsr_hook)`` (the README's second way), passes none.  The base
  class then calls :func:`for_model` on the model it was given, importing this module at that moment.

Why this, and not a list of providers that the adapters fill when they are imported: with such a registry the
facts depended on which modules happened to be imported before the state was built, and the algorithms layer
held global state that the adapters wrote into.  Here where each fact comes from is written once, in
:func:`for_model`, and read when needed: DDP's facts from a ``DistributedDataParallel`` model
(:mod:`commhooks.ddp`), ranks per node from the launcher's environment (:mod:`commhooks.launch`).  The facts are needed while the state is built (the handshake checks the
parameter names, the replica groups follow the ranks per node), so they cannot wait for the hook's
registration.  This module sits with the adapters; the base imports it only inside the call.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .algorithms.engine_facts import EngineFacts


def launcher_local_world_size() -> Optional[int]:
    """Ranks per node as the launcher's environment says (None: no launcher found, or its variables disagree;
    the algorithm then treats the world as one node)."""
    from .launch import LaunchError, discover

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
        from .ddp import buffers_broadcast_each_forward, include_in_join

        found = {"module": model.module, "buffers_synced_each_forward": buffers_broadcast_each_forward(model),
                 "attach": functools.partial(include_in_join, model)}
    else:
        found = {"module": model}
    if "local_world_size" not in known:
        found["local_world_size"] = launcher_local_world_size()
    return EngineFacts(**{**found, **known})
