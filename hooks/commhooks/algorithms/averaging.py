"""Model averaging shared by the algorithms: what a sync averages, and one flat call per dtype."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

import torch

# a synced tensor that is a view into an optimizer's parameter (DeepSpeed's fused fp16/bf16 master; the local part
# of FSDP2's DTensor): its id -> (that parameter, start, end) in the parameter's local elements, so the optimizer
# state (and the gradient) of just that stretch can be read or cleared
Slices = Optional[Dict[int, Tuple[torch.Tensor, int, int]]]

from ..comm import Comm

OPTIMIZER_STATE_FIELDS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def float_buffers(module: Optional[torch.nn.Module]) -> List[torch.Tensor]:
    """Floating buffers (BatchNorm statistics); integer ones such as ``num_batches_tracked`` are left alone."""
    return [] if module is None else [b for b in module.buffers() if torch.is_floating_point(b)]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (this rank's shard of an FSDP2 parameter, gradient or moment); any other tensor as it
    is.  A sync computes on local parts only: math on a DTensor would run collectives inside the shard group."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def optimizer_moments(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
                      slices: Slices = None) -> List[torch.Tensor]:
    """The moment tensors (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) of ``params``, as tensors that share
    their storage (a parameter that is a view into a flat one: the same stretch of the flat moments)."""
    out = []
    for p in params:
        where = (slices or {}).get(id(p))
        if where is not None:
            flat, a, b = where
            st = optimizer.state.get(flat, {})
            out += [local_part(st[f]).view(-1)[a:b] for f in OPTIMIZER_STATE_FIELDS
                    if isinstance(st.get(f), torch.Tensor)]
            continue
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


def clear_optimizer_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
                          slices: Slices = None) -> None:
    """Forget the state of ``params`` (momentum, Adam moments and step): the optimizer re-creates it lazily.

    A parameter that is a view into a flat one (``slices``): its stretch of the flat state's tensors is zeroed
    (the step count is the flat parameter's, shared); a flat parameter whose every stretch is cleared loses its
    whole state, as a plain one would."""
    cleared: Dict[int, List[Tuple[int, int]]] = defaultdict(list)
    flats: Dict[int, torch.Tensor] = {}
    for p in params:
        where = (slices or {}).get(id(p))
        if where is None:
            optimizer.state.pop(p, None)
            continue
        flat, a, b = where
        cleared[id(flat)].append((a, b))
        flats[id(flat)] = flat
    for key, stretches in cleared.items():
        flat = flats[key]
        numel = local_part(flat).numel()
        if sum(b - a for a, b in stretches) >= numel:
            optimizer.state.pop(flat, None)
            continue
        st = optimizer.state.get(flat, {})
        with torch.no_grad():
            for value in st.values():
                if isinstance(value, torch.Tensor) and local_part(value).numel() == numel:
                    for a, b in stretches:
                        local_part(value).view(-1)[a:b].zero_()
