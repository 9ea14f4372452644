"""Small helpers every algorithm module uses: warnings that point at the user's line, the optimizer inside a
framework's wrapper, checkpoint tensors moved to a device; a state's config and optimizers from its arguments."""

from __future__ import annotations

import torch

from ..settings import ConfigError
from ..sources import from_fields, load_as

_PACKAGE = __file__.rsplit("/algorithms/", 1)[0]  # .../commhooks
_TORCH = torch.__file__.rsplit("/", 1)[0]


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the user's line (the first frame outside commhooks and
    torch: the ``optimizer.step()`` or ``engine.step()`` of the loop), however deep the hooks call it."""
    import sys

    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename.startswith(_TORCH)):
        frame, level = frame.f_back, level + 1
    return level


def unwrap_optimizer(optimizer):
    """The torch optimizer inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``: both keep it as ``.optimizer``); the optimizer itself otherwise.  The step hooks
    the state registers must sit on the optimizer whose ``step()`` really runs."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def tensors_to(obj, device: torch.device):
    """``obj`` (dicts, lists, tuples of tensors and plain values) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: tensors_to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_to(v, device) for v in obj)
    return obj


def resolve_config(cls, config, settings: dict):
    """The config of state class ``cls`` from ``config=`` (object, dict, JSON path) or keyword ``settings``."""
    if config is not None and settings:
        raise ConfigError(f"pass either config= or keyword settings, not both (got {sorted(settings)})")
    return (load_as(cls.config_class, config) if config is not None
            else from_fields(cls.config_class, settings, where=cls.__name__))


def optimizer_list(optimizer) -> list:
    """``optimizer`` (one, or a list in the order the loop steps them) as a list of distinct torch optimizers,
    each unwrapped from a framework's wrapper."""
    opts = [unwrap_optimizer(o) for o in (list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])]
    for i, opt in enumerate(opts):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"optimizer[{i}] must be a torch.optim.Optimizer, got {type(opt).__name__}")
    if not opts or len({id(o) for o in opts}) != len(opts):
        raise ConfigError("optimizer must be an optimizer or a non-empty list of distinct optimizers")
    return opts
