"""``commhooks.deepspeed.initialize``: ``deepspeed.initialize`` with the ``"comm_hook"`` section attached.

The order matters, and is why this is more than ``deepspeed.initialize`` then ``attach``: the hook section is
validated and unsupported engine settings refused before DeepSpeed issues any collective (the same error on
every rank); for an algorithm with replica groups the batch size is shared per group (:func:`.keep_global_batch`)
and the engine is built with the groups as its ``mpu`` (:class:`.ReplicaGroups`), so DeepSpeed's own data
parallelism and ZeRO sharding stay inside each group; and ``training_data`` is re-sharded over the world,
since DeepSpeed would shard it over the (replica) data-parallel group only.
"""

from __future__ import annotations

import os
import warnings
from typing import Mapping

from .. import facts, registry
from ..config import ConfigError, load_config
from . import _compat
from .config import check_supported, fill_from_scheduler, keep_global_batch, read_ds_config
from .engine import attach
from .groups import ReplicaGroups


def initialize(args=None, model=None, model_parameters=None, config=None, **kwargs):
    """``deepspeed.initialize`` with the ``"comm_hook"`` section attached; same arguments, same return value.

    The DeepSpeed config comes from ``config`` (dict or JSON path) or from
    ``args.deepspeed_config``.  The hook section is validated, and unsupported
    engine settings refused, before DeepSpeed issues any collective.  With
    replica groups, the engine is built with their ``mpu``.
    """
    import deepspeed
    import torch.distributed as dist

    source = config if config is not None else getattr(args, "deepspeed_config", None)
    ds_config = read_ds_config(source)
    hook_section = ds_config.get("comm_hook")
    conf = load_config({"comm_hook": hook_section}) if hook_section is not None else None
    if conf is not None:
        check_supported(ds_config, conf)
        fill_from_scheduler(conf, ds_config)
    if config is None and args is not None and getattr(args, "deepspeed_config", None) is not None:
        config = ds_config  # DeepSpeed would re-read the file; hand it the dict we validated
        args.deepspeed_config = None
    elif isinstance(config, (str, os.PathLike)):
        config = ds_config  # a path or a shipped name: DeepSpeed gets the dict we read and validated
    if conf is not None:
        if not dist.is_initialized():
            deepspeed.init_distributed()
        world = dist.get_world_size()
        groups = registry.for_config(conf).state_class.data_parallel_groups(
            conf, world, facts.launcher_local_world_size())
        if groups is not None:
            if kwargs.get("mpu") is not None:
                raise ConfigError("comm_hook with replica groups builds DeepSpeed's data-parallel groups itself "
                                  "(mpu); a model-parallel mpu cannot be combined with it yet")
            # checked before the groups are made (a collective): a bad batch is the same error on every rank
            config = keep_global_batch(dict(config if isinstance(config, Mapping) else ds_config), world,
                                       len(groups[0]))
            kwargs["mpu"] = ReplicaGroups(groups)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model_parameters, config=config if config is not None else ds_config,
        **kwargs,
    )
    if conf is not None and kwargs.get("mpu") is not None and loader is not None:
        loader = _world_sharded_loader(engine, kwargs.get("training_data"))
    if hook_section is not None:
        attach(engine, conf)
    return engine, optimizer, loader, scheduler


def _world_sharded_loader(engine, dataset):
    """The ``training_data`` loader, sharded over the *world*, not the engine's data-parallel group.

    DeepSpeed shards ``training_data`` over its data-parallel group; replica groups make that group a
    replica (one rank with ``group_size`` 1), so every replica would read the same samples in the same order
    and local SGD would average models trained on identical data.  Each rank gets its own 1/world share, as
    under DDP with a ``DistributedSampler`` (shuffled, seed 0; ``loader.data_sampler.set_epoch`` as usual).
    An iterable dataset cannot be sharded by a sampler: shard it per ``dist.get_rank()`` yourself."""
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    if not _compat.is_map_style(engine, dataset):
        warnings.warn("comm_hook replica groups: DeepSpeed shards an iterable training_data over the replica "
                      "group only, so replicas may read the same samples; shard it by dist.get_rank() yourself",
                      stacklevel=3)
        return _compat.training_loader(engine)
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    return _compat.training_loader(engine, dataset, sampler)
