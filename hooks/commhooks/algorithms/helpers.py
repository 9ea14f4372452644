"""Small helpers every algorithm module uses: warnings that point at the user's line, the optimizer inside a
framework's wrapper, checkpoint tensors moved to a device."""

from __future__ import annotations

import torch

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
