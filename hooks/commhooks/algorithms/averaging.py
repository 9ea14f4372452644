"""Model averaging shared by the algorithms: what a sync averages, and one flat call per dtype."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Optional

import torch

from ..comm import Comm

OPTIMIZER_STATE_FIELDS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def float_buffers(module: Optional[torch.nn.Module]) -> List[torch.Tensor]:
    """Floating buffers (BatchNorm statistics); integer ones such as ``num_batches_tracked`` are left alone."""
    return [] if module is None else [b for b in module.buffers() if torch.is_floating_point(b)]


def optimizer_moments(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    out = []
    for p in params:
        st = optimizer.state.get(p, {})
        out += [st[f] for f in OPTIMIZER_STATE_FIELDS if isinstance(st.get(f), torch.Tensor)]
    return out


def average_(comm: Comm, tensors: Iterable[torch.Tensor], group=None, tag: str = "sync",
             rider: Optional[torch.Tensor] = None) -> None:
    """Average ``tensors`` in place over ``group``: one flat allreduce per (dtype, device).

    ``rider`` (float32, e.g. the step proof) travels first in the float32 call, or alone if there is none.
    """
    buckets: Dict[tuple, List[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        buckets[(t.dtype, t.device)].append(t)
    if rider is not None:
        key = next((k for k in buckets if k[0] == torch.float32), (torch.float32, rider.device))
        buckets[key].insert(0, rider)  # first: the caller makes it on the parameters' device
    with torch.no_grad():
        for same_kind in buckets.values():
            comm.allreduce([t.data for t in same_kind], op="mean", group=group, tag=tag)


def clear_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """Forget the state of ``params`` (momentum, Adam moments and step): the optimizer re-creates it lazily."""
    for p in params:
        optimizer.state.pop(p, None)
