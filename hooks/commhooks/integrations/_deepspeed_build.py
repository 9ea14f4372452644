"""Frameworks that build the DeepSpeed engine themselves (Accelerate, hence the Hugging Face Trainer) call
``deepspeed.initialize(model=..., config_params=...)``; a ``"comm_hook"`` section there needs the engine built
through :func:`commhooks.deepspeed.initialize` (replica groups as DeepSpeed's data-parallel groups, the global
batch kept, the hook attached).  :func:`route_initialize` sends the framework's call there; the original is
called from inside it, once (no re-entrancy), and every call without a ``comm_hook`` section is untouched."""

from __future__ import annotations

import threading

from ._common import objects_of

_LOCAL = threading.local()


def route_initialize() -> None:
    """Make ``deepspeed.initialize`` build engines whose config has a ``comm_hook`` section through commhooks."""
    import deepspeed

    if getattr(deepspeed.initialize, "_commhooks_route", False):
        return
    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        config = kwargs.get("config", kwargs.get("config_params"))
        if getattr(_LOCAL, "inside", False) or not isinstance(config, dict) or "comm_hook" not in config:
            return original(*args, **kwargs)
        from .. import deepspeed as ds_adapter

        kwargs = dict(kwargs)
        kwargs["config"] = kwargs.pop("config_params", kwargs.get("config"))
        _LOCAL.inside = True  # commhooks.deepspeed.initialize calls deepspeed.initialize: the original, this time
        try:
            return ds_adapter.initialize(*args, **kwargs)
        finally:
            _LOCAL.inside = False

    initialize._commhooks_route = True
    initialize.__wrapped__ = original
    deepspeed.initialize = initialize


def engine_of(module):
    """The DeepSpeed engine wrapping ``module`` (or ``module`` itself if it is one); None if none does."""
    from deepspeed import DeepSpeedEngine

    if isinstance(module, DeepSpeedEngine):
        return module
    return next((obj for obj in objects_of(DeepSpeedEngine) if getattr(obj, "module", None) is module), None)
