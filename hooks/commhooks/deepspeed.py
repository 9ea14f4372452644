"""DeepSpeed adapter: any commhooks algorithm inside a DeepSpeed engine, configured from its JSON.

DeepSpeed has no comm-hook API.  This adapter takes over gradient
communication at the gradient-accumulation boundary: it turns off
``engine.enable_backward_allreduce`` (the engine then only accumulates
gradients locally, as its own compressed optimizers do), and just before the
boundary ``engine.step()`` it reduces the gradients through the algorithm.
So ``gradient_accumulation_steps > 1`` works and counts optimizer steps, and
``gradient_clipping`` sees the communicated gradients.

Usage, the same call as ``deepspeed.initialize``::

    engine, optimizer, loader, scheduler = commhooks.deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), config="ds_config.json")

with a top-level ``"comm_hook"`` section in the DeepSpeed config (DeepSpeed
keeps unknown top-level keys and exposes them as ``engine.config``)::

    "comm_hook": {"type": "qsr", "h_base": 4, "alpha": 0.01, "warmup_steps": 50}

or, for an engine you already built, ``commhooks.deepspeed.attach(engine, config)``.

Supported: ZeRO stage 0, fp32 or torch autocast.  ZeRO >= 1 shards the
optimizer state and reduce-scatters gradients inside its own optimizer, so a
hook would average the wrong thing (and DeepSpeed's ``step()`` fails with the
backward allreduce off): it raises :class:`~commhooks.config.ConfigError`
before the engine is built.  DeepSpeed's fp16 / bf16 optimizers wrap the
optimizer the hooks attach to; they are refused the same way for now.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from . import registry
from .algorithms.base import engine_facts
from .config import ConfigError, load_config, read_json


def read_ds_config(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        return read_json(config, "DeepSpeed config")
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"DeepSpeed config must be a dict or a JSON path, got {type(config).__name__}")


def check_supported(ds_config: Mapping[str, Any]) -> None:
    """Refuse engine settings a hook cannot work with, before any collective (same error on every rank)."""
    stage = ds_config.get("zero_optimization", {}).get("stage", 0)
    if stage:
        raise ConfigError(
            f"comm_hook needs zero_optimization.stage 0, got {stage}: ZeRO >= 1 shards the optimizer state "
            "and reduce-scatters gradients inside its own optimizer, so the hook would average the wrong "
            "tensors and engine.step() fails without DeepSpeed's allreduce; use stage 0 with a comm_hook"
        )
    for key in ("fp16", "bf16"):
        if ds_config.get(key, {}).get("enabled", False):
            raise ConfigError(
                f"comm_hook with DeepSpeed's {key}.enabled=true is not supported yet (its mixed-precision "
                "optimizer wraps the optimizer the hook attaches to); use torch autocast or fp32"
            )


class _BoundaryReducer:
    """Replaces the engine's backward allreduce: reduce through the algorithm right before the boundary step."""

    def __init__(self, engine, state):
        self.engine = engine
        self.state = state
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        self._step = engine.step
        engine.enable_backward_allreduce = False
        engine.step = self.step  # instance attribute: shadows the method for this engine only

    def step(self, *args, **kwargs):
        if self.engine.is_gradient_accumulation_boundary() and self.state.reduces_gradients:
            for p in self.params:
                if p.grad is None:  # every rank must send the same tensors
                    p.grad = torch.zeros_like(p)
            self.state.reduce_gradients([p.grad for p in self.params], self.params).wait()
        return self._step(*args, **kwargs)


def attach(engine, config=None, process_group=None):
    """Attach a hook to a built engine; ``config`` defaults to ``engine.config["comm_hook"]``.

    Returns the algorithm's state (``state.meter``, ``state.state_dict()``),
    also kept as ``engine.comm_hook_state``.  ``{"type": "none"}`` keeps
    DeepSpeed's own allreduce and returns ``None``.
    """
    ds_config = engine.config if isinstance(getattr(engine, "config", None), Mapping) else {}
    if config is None:
        config = ds_config.get("comm_hook")
        if config is None:
            raise ConfigError("no comm_hook given and the DeepSpeed config has no 'comm_hook' section")
    conf = load_config(config)
    check_supported({"zero_optimization": {"stage": engine.zero_optimization_stage()},
                     "fp16": {"enabled": engine.fp16_enabled()}, "bf16": {"enabled": engine.bfloat16_enabled()}})
    if conf is None:
        engine.comm_hook_state = None
        return None
    state_class = registry.for_config(conf).state_class
    state = state_class(optimizer=engine.optimizer, model=engine.module, engine=engine_facts(engine.module),
                        process_group=process_group, config=conf)
    _BoundaryReducer(engine, state)
    engine.comm_hook_state = state
    return state


def initialize(args=None, model=None, model_parameters=None, config=None, **kwargs):
    """``deepspeed.initialize`` with the ``"comm_hook"`` section attached; same arguments, same return value.

    The DeepSpeed config comes from ``config`` (dict or JSON path) or from
    ``args.deepspeed_config``.  The hook section is validated, and unsupported
    engine settings refused, before DeepSpeed issues any collective.
    """
    import deepspeed

    source = config if config is not None else getattr(args, "deepspeed_config", None)
    ds_config = read_ds_config(source)
    hook_section = ds_config.get("comm_hook")
    conf = load_config({"comm_hook": hook_section}) if hook_section is not None else None
    if hook_section is not None and conf is not None:
        check_supported(ds_config)
    if config is None and args is not None and getattr(args, "deepspeed_config", None) is not None:
        config = ds_config  # DeepSpeed would re-read the file; hand it the dict we validated
        args.deepspeed_config = None
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model_parameters, config=config if config is not None else ds_config,
        **kwargs,
    )
    if hook_section is not None:
        attach(engine, conf)
    return engine, optimizer, loader, scheduler
