"""DeepSpeed adapter: any commhooks algorithm inside a DeepSpeed engine, configured from its JSON.

Usage, the same call as ``deepspeed.initialize``::

    engine, optimizer, loader, scheduler = commhooks.deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), config="ds_config.json")

with a top-level ``"comm_hook"`` section in the DeepSpeed config (DeepSpeed
keeps unknown top-level keys and exposes them as ``engine.config``)::

    "comm_hook": {"type": "qsr", "h_base": 4, "alpha": 0.01, "warmup_steps": 50, "group_size": 2}

or, for an engine you already built, ``commhooks.deepspeed.attach(engine, config)``.

DeepSpeed has no comm-hook API.  The adapter works in one of two ways,
chosen from what the algorithm declares (never from its name):

**Replica groups** (algorithms that declare ``data_parallel_groups``, e.g.
QSR): the engine's data-parallel group *is* the algorithm's replica group.
``initialize`` hands DeepSpeed an ``mpu`` (:class:`ReplicaGroups`) whose
``get_data_parallel_group()`` is this rank's replica group, so everything
DeepSpeed does every step (gradient allreduce or reduce-scatter, ZeRO
sharding of the optimizer state, the fp16 loss scaler's overflow check)
stays inside the group, on the fast links.  The algorithm syncs across
groups: it averages the tensors the inner optimizer steps (the fp32
*master* weights: with ZeRO 1/2 this rank's flat partition, averaged with
the same partition of the other groups), then the adapter refreshes the
low-precision weights from them (DeepSpeed's own ``update_lp_params``).
Works with fp32, ``bf16`` and ``fp16`` (DeepSpeed's loss scaler) at ZeRO
stage 0, 1 and 2.  ``group_size`` 1 (the default) makes every rank its own
replica (ZeRO then has nothing to shard).

**Hook reduces** (algorithms that reduce gradients themselves, e.g. AB):
``engine.enable_backward_allreduce`` is turned off (the engine then only
accumulates gradients locally, as its own compressed optimizers do), and
just before the boundary ``engine.step()`` the gradients are reduced
through the algorithm (in fp32 when the model is bf16).  ZeRO stage 0 only,
fp32 or ``bf16``: ZeRO >= 1 reduce-scatters flat gradient partitions that
cut through the weight matrices such an algorithm works on, and the fp16
loss scaler scales each rank's gradients by its own factor.

In both, optimizer steps are counted by the adapter at the accumulation
boundary (``gradient_accumulation_steps`` counts optimizer steps), skipped
fp16 steps included, so every rank keeps the same schedule; periods that
depend on the lr are agreed across ranks once per round, because
DeepSpeed does not step the lr scheduler of a rank whose step overflowed.

ZeRO stage 3 is refused: it partitions the parameters themselves and
gathers them layer by layer inside forward and backward, so there is no
per-rank tensor to average between syncs without a full gather.

The package, one job per module: :mod:`.config` reads the DeepSpeed config
(the hook section, the scheduler, the support matrix, the batch per replica
group); :mod:`.groups` is the ``mpu``; :mod:`.build` is :func:`initialize`;
:mod:`.engine` is :func:`attach` and the wrapped ``engine.step``;
:mod:`.checkpoint` writes and reads per replica group; :mod:`._compat` is
the only module that touches DeepSpeed's internals (and names the DeepSpeed
versions it was checked on).  Importing the package imports no DeepSpeed.
"""

from .build import initialize
from .checkpoint import load_checkpoint, save_checkpoint
from .config import check_supported, fill_from_scheduler, keep_global_batch, read_ds_config
from .engine import attach
from .groups import ReplicaGroups

__all__ = ["initialize", "attach", "ReplicaGroups", "save_checkpoint", "load_checkpoint", "read_ds_config",
           "check_supported", "fill_from_scheduler", "keep_global_batch"]
