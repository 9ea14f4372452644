"""The DeepSpeed config as commhooks reads it: the ``"comm_hook"`` section, the scheduler, the support matrix.

Everything here is plain dict reading, done before DeepSpeed issues any collective, so a setting the hook
cannot work with is the same ConfigError on every rank (not a hang in the first step):

* :func:`read_ds_config`: a DeepSpeed config from a dict, a JSON path or a shipped name;
* :func:`fill_from_scheduler`: hook keys that follow the lr schedule (warm-up, run length) taken from
  DeepSpeed's own ``scheduler`` section when the hook section leaves them unset, so the user writes them once;
* :func:`check_supported`: the support matrix (ZeRO stage, precision, offload, gradient accumulation), chosen
  from what the algorithm declares, never from its name;
* :func:`keep_global_batch`: ``train_batch_size`` per replica group, so the global batch stays the user's.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from .. import registry, shipped
from ..config import ConfigError, load_config, read_json

log = logging.getLogger("commhooks")


def read_ds_config(config) -> dict:
    """The DeepSpeed config as a dict: ``config`` is a dict, a JSON path, a shipped config's name (e.g.
    ``"ds_qsr_bf16_zero2"``) or None (an empty config)."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        if isinstance(config, str) and shipped.is_bare_name(config):
            config = shipped.find(config)  # a shipped DeepSpeed config by name, e.g. "ds_qsr_bf16_zero2"
        return read_json(config, "DeepSpeed config")
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"DeepSpeed config must be a dict or a JSON path, got {type(config).__name__}")


# DeepSpeed's warm-up schedulers: where their warm-up and total lengths are, and the warm-up default
_SCHEDULERS = {"WarmupLR": ("warmup_num_steps", None), "WarmupDecayLR": ("warmup_num_steps", "total_num_steps"),
               "WarmupCosineLR": ("warmup_num_steps", "total_num_steps")}


def fill_from_scheduler(conf, ds_config: Mapping[str, Any]) -> dict:
    """Fill the hook keys that follow the lr schedule (the config class's ``schedule_keys``) from DeepSpeed's
    ``scheduler`` section when the hook section leaves them unset; returns what was filled."""
    scheduler = ds_config.get("scheduler") or {}
    kind, params = scheduler.get("type"), scheduler.get("params") or {}
    if conf is None or kind not in _SCHEDULERS:
        return {}
    warmup_key, total_key = _SCHEDULERS[kind]
    values = {"warmup": params.get(warmup_key, 1000),  # DeepSpeed's default warm-up length
              "total": params.get(total_key) if total_key else None}
    filled, idle = {}, conf.inactive_keys()  # (a key that would change nothing is not filled: the warm-up of a
    for key, what in getattr(type(conf), "schedule_keys", {}).items():  # constant period, say)
        unset = key not in conf.model_fields_set or getattr(conf, key) is None  # absent, or written as null
        if unset and values.get(what) is not None and key not in idle:
            setattr(conf, key, int(values[what]))
            filled[key] = int(values[what])
    if filled:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("commhooks: %s taken from DeepSpeed's scheduler %s (set them in the comm_hook section to "
                        "override)", ", ".join(f"{conf.kind}.{k}={v}" for k, v in filled.items()), kind)
    return filled


def _precision(ds_config: Mapping[str, Any]) -> str:
    for key in ("fp16", "bf16", "bfloat16"):
        if (ds_config.get(key) or {}).get("enabled", False) is True:
            return "bf16" if key == "bfloat16" else key
    return "fp32"


def check_supported(ds_config: Mapping[str, Any], conf=None) -> None:
    """Refuse engine settings the hook cannot work with, before any collective (same error on every rank).

    ``conf`` is the hook's config (the ``comm_hook`` section when omitted)."""
    if conf is None:
        conf = load_config({"comm_hook": ds_config.get("comm_hook")}) if ds_config.get("comm_hook") else None
    if conf is None:
        return
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    precision = _precision(ds_config)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"comm_hook needs zero_optimization.stage 0, 1, 2 or 3, got {stage}")
    if ds_config.get("managed_gradient_accumulation", True) is False:
        raise ConfigError(
            "comm_hook needs DeepSpeed to manage gradient accumulation (managed_gradient_accumulation: true, "
            "its default): with it off, engine.step() cannot tell the accumulation boundary, where the hook counts "
            "optimizer steps")
    zero = ds_config.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device not in (None, "none"):
            raise ConfigError(
                f"comm_hook with zero_optimization.{key}.device={device!r} is not supported yet: the fp32 masters a "
                "sync averages would live off the accelerator, outside the process group's device; drop the "
                "offload (or use the hook without it)")
    if registry.for_config(conf).state_class.engine_data_parallel:
        return  # replica groups: DeepSpeed's own data parallelism inside, any precision, ZeRO 0-3 (a sync averages
        # each rank's fp32 partition with its counterparts: at stage 3 the partition of the parameters themselves)
    if stage:
        raise ConfigError(
            f"comm_hook type {conf.kind!r} needs zero_optimization.stage 0, got {stage}: it reduces gradients "
            "itself, per weight matrix, and ZeRO >= 1 reduce-scatters flat gradient partitions that cut through "
            "the matrices inside its own optimizer (ZeRO-3 partitions the parameters themselves); use stage 0 (fp32 "
            "or bf16, with DeepSpeed's Adam/AdamW or your own optimizer), or a hook with replica groups (qsr) for "
            "ZeRO 1-3")
    if precision == "fp16":
        raise ConfigError(
            f"comm_hook type {conf.kind!r} does not support DeepSpeed's fp16.enabled=true: it averages gradients "
            "across ranks itself, and DeepSpeed's loss scaler scales each rank's gradients by its own factor; "
            "use \"bf16\": {\"enabled\": true} (no loss scaling), or torch autocast with fp32 weights")


def keep_global_batch(ds_config: dict, world: int, replica: int) -> dict:
    """The DeepSpeed config with ``train_batch_size`` per replica group, so the *global* batch stays the user's.

    DeepSpeed reads ``train_batch_size`` as micro-batch x accumulation x data-parallel ranks.  Replica groups
    make its data-parallel group the replica (``replica`` ranks, often 1), so the same file would give each
    rank ``world / replica`` times the micro-batch it gets without commhooks (the DeepSpeedExamples CIFAR
    config's 16 became 16 per rank on 2 ranks).  Here ``train_batch_size`` becomes its share per replica
    group (``x replica / world``): micro-batch and accumulation come out as without commhooks, and the
    run takes the same number of samples per step.  A size the groups cannot share evenly, or a file whose
    three batch keys disagree over the world, is a ConfigError naming the keys.  Logged on rank 0."""
    total = ds_config.get("train_batch_size")
    if total is None or world == replica:
        return ds_config
    micro, accumulation = ds_config.get("train_micro_batch_size_per_gpu"), ds_config.get("gradient_accumulation_steps")
    groups = world // replica
    if micro is not None and accumulation is not None and micro * accumulation * world != total:
        raise ConfigError(
            f"DeepSpeed config: train_batch_size {total} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accumulation} x {world} ranks (DeepSpeed refuses it without commhooks too)")
    if total % groups or (total // groups) % replica:
        raise ConfigError(
            f"DeepSpeed config: train_batch_size {total} cannot be shared by the {world} ranks in {groups} replica "
            f"groups of {replica} (comm_hook group_size): use a multiple of {world}, or give "
            "train_micro_batch_size_per_gpu instead")
    per_group = total // groups
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning("commhooks: train_batch_size %d is the global batch over %d ranks; DeepSpeed's data-parallel "
                    "group is a replica group of %d, so it gets train_batch_size %d (micro-batch x accumulation "
                    "per rank: %d, as without commhooks)", total, world, replica, per_group, total // world)
    return {**ds_config, "train_batch_size": per_group}

