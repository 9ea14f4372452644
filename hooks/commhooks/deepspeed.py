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
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, List, Mapping, Optional, Tuple

import torch

from . import facts, registry
from .algorithms import replicas
from .config import ConfigError, load_config, read_json


def read_ds_config(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        from . import shipped

        if isinstance(config, str) and shipped.is_bare_name(config):
            config = shipped.find(config)  # a shipped DeepSpeed config by name, e.g. "ds_qsr_bf16_zero2"
        return read_json(config, "DeepSpeed config")
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"DeepSpeed config must be a dict or a JSON path, got {type(config).__name__}")


log = logging.getLogger("commhooks")

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
    filled = {}
    for key, what in getattr(type(conf), "schedule_keys", {}).items():
        unset = key not in conf.model_fields_set or getattr(conf, key) is None  # absent, or written as null
        if unset and values.get(what) is not None:
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
    if stage not in (0, 1, 2):
        raise ConfigError(
            f"comm_hook needs zero_optimization.stage 0, 1 or 2, got {stage}: ZeRO-3 partitions the parameters "
            "themselves and gathers them layer by layer inside forward and backward, so there is no per-rank "
            "model to average between syncs; use stage 2 (optimizer state and gradients sharded inside the "
            "replica group) with a comm_hook")
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
        return  # replica groups: DeepSpeed's own data parallelism inside, any precision, ZeRO 0-2
    if stage:
        raise ConfigError(
            f"comm_hook type {conf.kind!r} needs zero_optimization.stage 0, got {stage}: it reduces gradients "
            "itself, per weight matrix, and ZeRO >= 1 reduce-scatters flat gradient partitions that cut through "
            "the matrices inside its own optimizer; use stage 0 (fp32 or bf16, with DeepSpeed's Adam/AdamW or your "
            "own optimizer), or a hook with "
            "replica groups (qsr) for ZeRO 1/2")
    if precision == "fp16":
        raise ConfigError(
            f"comm_hook type {conf.kind!r} does not support DeepSpeed's fp16.enabled=true: it averages gradients "
            "across ranks itself, and DeepSpeed's loss scaler scales each rank's gradients by its own factor; "
            "use \"bf16\": {\"enabled\": true} (no loss scaling), or torch autocast with fp32 weights")


# ------------------------------------------------------------------ replica groups as DeepSpeed's mpu


class ReplicaGroups:
    """An ``mpu`` for ``deepspeed.initialize``: the data-parallel group is this rank's replica group.

    Model parallelism is not used: the model-parallel group is the rank alone.  Built collectively
    (every rank creates every group, in the same order).
    """

    def __init__(self, groups: List[Tuple[int, ...]]):
        import torch.distributed as dist

        rank = dist.get_rank()
        self.groups = groups
        self.ranks = groups[replicas.group_of(groups, rank)]
        handles = [dist.new_group(list(g)) for g in groups]
        self._dp = handles[replicas.group_of(groups, rank)]
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
        self._mp = singles[rank]
        self._rank = rank

    @classmethod
    def for_config(cls, conf, world_size: int, local_world_size: Optional[int]) -> Optional["ReplicaGroups"]:
        """The mpu for hook config ``conf``, or None when the algorithm reduces gradients itself."""
        state_class = registry.for_config(conf).state_class
        groups = state_class.data_parallel_groups(conf, world_size, local_world_size)
        return None if groups is None else cls(groups)

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self) -> int:
        return self.ranks.index(self._rank)

    def get_data_parallel_world_size(self) -> int:
        return len(self.ranks)

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self.ranks)

    def get_model_parallel_group(self):
        return self._mp

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._rank


# ------------------------------------------------------------------ what the engine's optimizer steps


def _masters(engine):
    """(named master tensors, the module parameter of each or None, refresh, slices) for the engine's optimizer.

    fp32 at ZeRO 0: the module's own parameters, nothing to refresh.  DeepSpeed's fp16/bf16 optimizer at
    ZeRO 0: one fp32 copy per parameter (same shape), refreshed by copying.  Its fused variant (DeepSpeed's
    ``"Adam"``/``"AdamW"``: FusedAdam inside ``FP16_Optimizer``) keeps one flat fp32 master per param group:
    handed over as one view per parameter (its shape, its name), so per-layer algorithms see each layer's
    matrix, with ``slices`` mapping each view to its stretch of the flat master (whose optimizer state is
    one).  ZeRO 1/2 and the BF16 optimizer: this rank's flat fp32 partition per param group, refreshed by
    DeepSpeed's ``update_lp_params`` (copy into the low-precision partition, all-gather inside the
    data-parallel group).
    """
    wrapper, inner = engine.optimizer, engine.basic_optimizer
    if wrapper is inner:
        return list(engine.module.named_parameters()), None, None, None
    if hasattr(wrapper, "fp32_groups") and hasattr(wrapper, "fp16_groups"):  # fp16/bf16 at ZeRO 0
        name_of = {id(p): n for n, p in engine.module.named_parameters()}
        named, lows = [], []
        for i, (highs, lowgroup) in enumerate(zip(wrapper.fp32_groups, wrapper.fp16_groups)):
            for j, (hi, lo) in enumerate(zip(highs, lowgroup)):
                named.append((name_of.get(id(lo), f"group{i}.param{j}"), hi))
                lows.append(lo)

        @torch.no_grad()
        def refresh():
            for (_, hi), lo in zip(named, lows):
                lo.copy_(hi)

        return named, lows, refresh, None
    if hasattr(wrapper, "fp32_groups_flat") and hasattr(wrapper, "fp16_groups"):  # fused: one flat master per group
        name_of = {id(p): n for n, p in engine.module.named_parameters()}
        named, lows, slices = [], [], {}
        for i, (flat, group) in enumerate(zip(wrapper.fp32_groups_flat, wrapper.fp16_groups)):
            offset = 0
            for j, lo in enumerate(group):
                view = flat.detach().view(-1)[offset: offset + lo.numel()].view_as(lo)  # shares the flat's storage
                named.append((name_of.get(id(lo), f"group{i}.param{j}"), view))
                lows.append(lo)
                slices[id(view)] = (flat, offset, offset + lo.numel())
                offset += lo.numel()

        @torch.no_grad()
        def refresh_flat():  # what FP16_Optimizer.step does after its update
            for (_, hi), lo in zip(named, lows):
                lo.data.copy_(hi)

        return named, lows, refresh_flat, slices
    if hasattr(wrapper, "update_lp_params"):  # ZeRO 1/2, BF16_Optimizer: flat partitions
        named = [(f"partition.group{i}.{j}", p) for i, g in enumerate(inner.param_groups) for j, p in enumerate(g["params"])]
        return named, None, wrapper.update_lp_params, None
    raise ConfigError(f"comm_hook does not know DeepSpeed's optimizer {type(wrapper).__name__} (its fp32 master "
                      "weights are where a sync must act); use fp32, bf16 or fp16 at ZeRO stage 0, 1 or 2")


def _may_skip_steps(engine) -> bool:
    """Whether DeepSpeed may skip an optimizer step (and its lr-scheduler step) on an overflow: fp16's loss
    scaler, and bf16 with ``check_grad_overflow`` (DeepSpeed's default)."""
    if engine.fp16_enabled():
        return True
    bf16 = getattr(getattr(engine, "_config", None), "bfloat16_config", None)
    return engine.bfloat16_enabled() and bool(getattr(bf16, "check_grad_overflow", True))


class _StepDriver:
    """Wraps ``engine.step``: at the accumulation boundary, reduce through the algorithm (if it does),
    then count the optimizer step on the state (skipped fp16 steps too)."""

    def __init__(self, engine, state, lows: Optional[List[torch.Tensor]], drives: bool, engine_reduces: bool):
        self.engine, self.state, self.drives = engine, state, drives
        self.params = [p for _, p in state.named_params]  # what the algorithm names (masters or parameters)
        self.lows = lows if lows is not None else self.params  # where the engine's gradients are
        self._step = engine.step
        if not engine_reduces:  # the engine only accumulates locally; the algorithm decides what is sent
            engine.enable_backward_allreduce = False
        engine.step = self.step  # instance attribute: shadows the method for this engine only

    def _reduce(self) -> None:
        grads = []
        for p in self.lows:
            if p.grad is None:  # every rank must send the same tensors
                p.grad = torch.zeros_like(p)
            grads.append(p.grad if p.grad.dtype == torch.float32 else p.grad.float())
        self.state.reduce_bucket(grads, self.params).wait()
        for p, g in zip(self.lows, grads):
            if g is not p.grad:
                p.grad.copy_(g)

    def step(self, *args, **kwargs):
        if not self.engine.is_gradient_accumulation_boundary():
            return self._step(*args, **kwargs)
        if self.state.reduces_gradients:
            self._reduce()
        if self.drives:
            self.state.begin_step()
        skipped = self.engine.skipped_steps
        out = self._step(*args, **kwargs)
        if self.drives:
            self.state.skipped_steps += self.engine.skipped_steps - skipped
            self.state.end_step()
        return out


def attach(engine, config=None, process_group=None):
    """Attach a hook to a built engine; ``config`` defaults to ``engine.config["comm_hook"]``.

    Returns the algorithm's state (``state.meter``, ``state.state_dict()``),
    also kept as ``engine.comm_hook_state``.  ``{"type": "none"}`` keeps
    DeepSpeed's own allreduce and returns ``None``.  An algorithm with replica
    groups needs the engine built with their ``mpu`` (:func:`initialize` does
    that; by hand: ``deepspeed.initialize(..., mpu=ReplicaGroups.for_config(...))``).
    """
    ds_config = engine.config if isinstance(getattr(engine, "config", None), Mapping) else {}
    if config is None:
        config = ds_config.get("comm_hook")
        if config is None:
            raise ConfigError("no comm_hook given and the DeepSpeed config has no 'comm_hook' section")
    conf = load_config(config)
    if conf is None:
        engine.comm_hook_state = None
        return None
    if config is ds_config.get("comm_hook"):  # the engine's own section: its scheduler says how long things are
        fill_from_scheduler(conf, ds_config)
    check_supported({"zero_optimization": {"stage": engine.zero_optimization_stage()},
                     "fp16": {"enabled": engine.fp16_enabled()}, "bf16": {"enabled": engine.bfloat16_enabled()}}, conf)
    state_class = registry.for_config(conf).state_class
    local_world_size = facts.launcher_local_world_size()
    import torch.distributed as dist

    world = dist.get_world_size()
    groups = state_class.data_parallel_groups(conf, world, local_world_size)
    if getattr(engine, "comm_hook_state", None) is not None:
        raise ConfigError("this engine already has a comm hook (engine.comm_hook_state); build a new engine to change it")
    mine = next((g for g in groups if dist.get_rank() in g), ()) if groups is not None else ()
    dp_group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    dp_ranks = tuple(dist.get_process_group_ranks(dp_group)) if dp_group is not None else ()
    replica_parallel = groups is not None and engine.dp_world_size == len(mine) and (
        not dp_ranks or tuple(sorted(dp_ranks)) == tuple(mine))
    if groups is not None and not replica_parallel and (engine.zero_optimization_stage() or engine.optimizer is not engine.basic_optimizer):
        # (fp32 at ZeRO 0 without the groups' mpu still works: the hook then reduces inside the groups itself)
        raise ConfigError(
            f"comm_hook group size {len(groups[0])} needs the engine's data-parallel group to be the replica group, "
            f"but the engine was built with {engine.dp_world_size} data-parallel ranks; build it with "
            "commhooks.deepspeed.initialize (or pass mpu=commhooks.deepspeed.ReplicaGroups.for_config(...) to "
            "deepspeed.initialize)")
    named, lows, refresh, slices = _masters(engine)
    drives = engine.optimizer is not engine.basic_optimizer  # DeepSpeed's wrappers step the inner one per group
    engine_facts = facts.for_model(engine.module, local_world_size=local_world_size, drives_steps=drives,
                                   replica_data_parallel=replica_parallel, lr_may_differ=drives and _may_skip_steps(engine),
                                   tensors_changed=refresh, master_slices=slices)
    state = state_class(optimizer=engine.basic_optimizer, named_parameters=named, engine=engine_facts,
                        process_group=process_group, config=conf)
    _StepDriver(engine, state, lows, drives, engine_reduces=replica_parallel)
    engine.comm_hook_state = state
    _route_checkpoints(engine)  # whoever saves the engine (the HF Trainer, Accelerate, you) saves every replica
    return state


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


def _world_sharded_loader(engine, dataset):
    """The ``training_data`` loader, sharded over the *world*, not the engine's data-parallel group.

    DeepSpeed shards ``training_data`` over its data-parallel group; replica groups make that group a
    replica (one rank with ``group_size`` 1), so every replica would read the same samples in the same order
    and local SGD would average models trained on identical data.  Each rank gets its own 1/world share, as
    under DDP with a ``DistributedSampler`` (shuffled, seed 0; ``loader.data_sampler.set_epoch`` as usual).
    An iterable dataset cannot be sharded by a sampler: shard it per ``dist.get_rank()`` yourself."""
    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    if not engine.is_map_style_dataset(dataset):
        warnings.warn("comm_hook replica groups: DeepSpeed shards an iterable training_data over the replica "
                      "group only, so replicas may read the same samples; shard it by dist.get_rank() yourself",
                      stacklevel=3)
        return engine.training_dataloader
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    engine.training_dataloader = engine.deepspeed_io(dataset, data_sampler=sampler)
    return engine.training_dataloader


# ------------------------------------------------------------------ checkpoints


def _replica_dir(engine, path) -> str:
    """Where this rank's replica group writes under ``path``: ``path`` itself for the first group (so the folder
    looks as DeepSpeed's own, ``path/<tag>/...``, for tools that look there: the Hugging Face Trainer checks for
    ``global_step*``), ``path/replica<g>`` for the others.  DeepSpeed names its files by data-parallel rank, so
    groups whose weights and optimizer states differ between syncs must not write into the same folder."""
    state = getattr(engine, "comm_hook_state", None)
    import torch.distributed as dist

    if state is None or not state.engine.replica_data_parallel or engine.dp_world_size == dist.get_world_size():
        return str(path)
    group = dist.get_rank() // engine.dp_world_size
    return str(path) if group == 0 else os.path.join(str(path), f"replica{group}")


def _route_checkpoints(engine) -> None:
    """Make the engine's own ``save_checkpoint`` / ``load_checkpoint`` (what the Hugging Face Trainer, Accelerate and
    users call) write and read per replica group and carry the hook's per-rank state; both stay collective."""
    if getattr(engine, "_commhooks_checkpoints", False):
        return
    original_save, original_load = engine.save_checkpoint, engine.load_checkpoint

    def save(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        return _save(engine, original_save, save_dir, tag, client_state, save_latest, **kwargs)

    def load(load_dir, tag=None, **kwargs):
        return _load(engine, original_load, load_dir, tag, **kwargs)

    engine.save_checkpoint, engine.load_checkpoint = save, load  # instance attributes: this engine only
    engine._commhooks_checkpoints = True


def _save(engine, original, save_dir, tag, client_state, save_latest, **kwargs):
    import torch.distributed as dist

    where = _replica_dir(engine, save_dir)
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    state = getattr(engine, "comm_hook_state", None)
    if state is not None and hasattr(state, "refuse_nonfinite_everywhere"):  # all ranks refuse together, before
        state.refuse_nonfinite_everywhere(f"checkpoint at step {state.step} (nothing was written)")  # any write
    out = original(where, tag=tag, client_state=client_state or {}, save_latest=save_latest, **kwargs)
    if save_latest and dist.get_rank() != 0 and where != str(save_dir) and (
            dist.get_rank() % engine.dp_world_size == 0):  # DeepSpeed writes 'latest' on global rank 0 only
        with open(os.path.join(where, "latest"), "w") as fd:
            fd.write(str(tag))
    state = getattr(engine, "comm_hook_state", None)
    if state is not None:
        os.makedirs(os.path.join(where, str(tag)), exist_ok=True)
        torch.save(state.state_dict(), os.path.join(where, str(tag), f"comm_hook_rank{dist.get_rank()}.pt"))
    dist.barrier()
    return out


def _load(engine, original, load_dir, tag=None, **kwargs):
    import torch.distributed as dist

    from .checkpoint import CheckpointError

    where = _replica_dir(engine, load_dir)
    path, client_state = original(where, tag=tag, **kwargs)
    device = next(engine.module.parameters()).device  # the process group's device (NCCL: the GPU)
    loaded = torch.tensor([0.0 if path is None else 1.0, 1.0 if path is None else 0.0], device=device)
    dist.all_reduce(loaded)  # how many ranks loaded, how many found nothing: all or none, or an error everywhere
    if loaded[0] and loaded[1]:
        raise CheckpointError(
            f"{int(loaded[1])} rank(s) found no checkpoint under {load_dir} (this rank looked in {where}, tag "
            f"{tag!r}) while {int(loaded[0])} loaded one: every replica group needs its own folder, as "
            "commhooks.deepspeed.save_checkpoint writes them")
    state = getattr(engine, "comm_hook_state", None)
    if state is not None and path is not None:
        hook_file = os.path.join(os.path.dirname(path) if os.path.isfile(path) else path,
                                 f"comm_hook_rank{dist.get_rank()}.pt")
        if not os.path.exists(hook_file):
            raise CheckpointError(f"{hook_file} is missing: the checkpoint was not written by an engine with the "
                                  "comm hook attached (the hook's schedule and each replica's state cannot resume)")
        state.load_state_dict(torch.load(hook_file, map_location="cpu", weights_only=True))
    return path, client_state


def save_checkpoint(engine, save_dir, tag=None, client_state=None, **kwargs):
    """``engine.save_checkpoint`` with the hook's state, per replica group; collective (every rank calls it).

    Since the hook is attached, the engine's own ``save_checkpoint`` does the same (it is routed): this name
    stays for scripts that use it.  Resumes exactly with :func:`load_checkpoint` (or the engine's own) on the
    same layout: the first replica group's files in ``save_dir``, the others' in ``save_dir/replica<g>``, each
    rank's hook state (``comm_hook_rank<r>.pt``) beside DeepSpeed's files.  Returns what DeepSpeed returns."""
    _route_checkpoints(engine)
    return engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, **kwargs)


def load_checkpoint(engine, load_dir, tag=None, **kwargs):
    """``engine.load_checkpoint`` with the hook's state saved by :func:`save_checkpoint`; returns DeepSpeed's
    ``(path, client_state)``.  A missing hook state raises :class:`~commhooks.checkpoint.CheckpointError`."""
    _route_checkpoints(engine)
    return engine.load_checkpoint(load_dir, tag=tag, **kwargs)
