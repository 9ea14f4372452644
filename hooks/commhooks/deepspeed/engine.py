"""A commhooks algorithm attached to a built DeepSpeed engine, and ``engine.step`` driving it.

DeepSpeed has no comm-hook API, so the adapter wraps ``engine.step`` (an instance attribute: this engine
only).  At the accumulation boundary (``gradient_accumulation_steps`` counts optimizer steps) it

* reduces the gradients through the algorithm, for an algorithm that declares ``reduces_gradients`` (the
  engine's own backward allreduce is off then: it only accumulates locally);
* counts the optimizer step on the state (``begin_step`` / ``end_step``) when DeepSpeed's wrappers step the
  inner optimizer (once per param group, or not at all on an overflow, so its step hooks cannot count), skipped
  fp16/bf16 steps included, so every rank keeps the same schedule.

:func:`attach` chooses what to do from what the algorithm declares (never from its name) and what the engine
says about itself (read through :mod:`._compat`), builds the engine facts and the state, and routes the
engine's own checkpoints per replica group (:mod:`.checkpoint`).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from .. import facts, registry
from ..config import ConfigError, load_config
from . import _compat
from .checkpoint import route_checkpoints
from .config import check_supported, fill_from_scheduler


class _StepDriver:
    """Wraps ``engine.step``: at the accumulation boundary, reduce through the algorithm (if it does),
    then count the optimizer step on the state (skipped fp16 steps too)."""

    def __init__(self, engine, state, lows: Optional[List[torch.Tensor]], drives: bool, engine_reduces: bool):
        self.engine, self.state, self.drives = engine, state, drives
        self.params = [p for _, p in state.named_params]  # what the algorithm names (masters or parameters)
        self.lows = lows if lows is not None else self.params  # where the engine's gradients are
        self._step = engine.step
        if not engine_reduces:  # the engine only accumulates locally; the algorithm decides what is sent
            _compat.stop_backward_allreduce(engine)
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
        skipped = _compat.skipped_steps(self.engine)
        out = self._step(*args, **kwargs)
        if self.drives:
            self.state.skipped_steps += _compat.skipped_steps(self.engine) - skipped
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
    ds_config = _compat.config_of(engine)
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
    dp_ranks = _compat.data_parallel_ranks(engine)
    replica_parallel = groups is not None and engine.dp_world_size == len(mine) and (
        not dp_ranks or tuple(sorted(dp_ranks)) == tuple(mine))
    if groups is not None and not replica_parallel and (engine.zero_optimization_stage() or _compat.wraps_optimizer(engine)):
        # (fp32 at ZeRO 0 without the groups' mpu still works: the hook then reduces inside the groups itself)
        raise ConfigError(
            f"comm_hook group size {len(groups[0])} needs the engine's data-parallel group to be the replica group, "
            f"but the engine was built with {engine.dp_world_size} data-parallel ranks; build it with "
            "commhooks.deepspeed.initialize (or pass mpu=commhooks.deepspeed.ReplicaGroups.for_config(...) to "
            "deepspeed.initialize)")
    named, lows, refresh, slices = _compat.masters(engine)
    drives = _compat.wraps_optimizer(engine)  # DeepSpeed's wrappers step the inner one per group
    engine_facts = facts.for_model(engine.module, local_world_size=local_world_size, drives_steps=drives,
                                   replica_data_parallel=replica_parallel,
                                   lr_may_differ=drives and _compat.may_skip_steps(engine),
                                   tensors_changed=refresh, master_slices=slices)
    state = state_class(optimizer=_compat.inner_optimizer(engine), named_parameters=named, engine=engine_facts,
                        process_group=process_group, config=conf)
    _StepDriver(engine, state, lows, drives, engine_reduces=replica_parallel)
    engine.comm_hook_state = state
    route_checkpoints(engine)  # whoever saves the engine (the HF Trainer, Accelerate, you) saves every replica
    return state
