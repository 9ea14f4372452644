"""Measuring traffic the same way for every method: payload handed to torch.distributed, and bytes on the wire.

:class:`PayloadCounter` wraps torch.distributed's collectives (and
DeepSpeed's bound copies) for the duration of a ``with`` block, so torch's own hooks (fp16, PowerSGD,
model averaging), which never see commhooks' meter, are counted exactly like
ours.  It calls straight through to the real collective.  :func:`iface_bytes`
reads the kernel's counters of a network interface (in the benchmark, each
rank's veth in its own network namespace): what really crossed the wire,
headers and retransmissions included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch.distributed as dist

from ..deepspeed._compat import comm_backend


class PayloadCounter:
    """Counts payload bytes and calls of torch.distributed's collectives while active, in total and by group.

    Bytes per call: what this rank hands to the collective, its contribution: the tensor of an all-reduce
    or reduce, the input of a reduce-scatter, the local part of an all-gather (as commhooks' meter counts
    it), a broadcast at its source only.  DeepSpeed binds
    its reduce-scatter and all-gather functions when it starts; those bound copies are wrapped too, so
    ZeRO's traffic counts like everyone else's.  ``by_group`` maps the ranks of each group (a tuple) to
    its bytes; ``log`` (with ``log_calls=True``) keeps ``(ranks, bytes)`` per call.
    """

    # torch 2.13's all_gather_single / reduce_scatter_single are the new names of all_gather_into_tensor /
    # reduce_scatter_tensor (kept as deprecated aliases that call them inside c10d, so nothing counts twice)
    FUNCTIONS = ("all_reduce", "reduce", "broadcast", "reduce_scatter_tensor", "_reduce_scatter_base",
                 "reduce_scatter_single", "all_gather_into_tensor", "_all_gather_base", "all_gather_single",
                 "all_gather", "reduce_scatter", "all_to_all_single")

    def __init__(self, log_calls: bool = False):
        self.bytes = 0
        self.calls = 0
        self.by_group: Dict[tuple, int] = {}
        self.log = [] if log_calls else None
        self._saved = []

    def _count(self, name, args, kwargs):
        group = kwargs.get("group")
        if name == "broadcast":
            src = kwargs.get("src", args[1] if len(args) > 1 else None)
            if dist.get_rank() != src:
                return
        if name in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single"):
            t = kwargs.get("input", args[1] if len(args) > 1 else None)
        elif name in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
            t = kwargs.get("input_tensor", args[1] if len(args) > 1 else None)
        elif name == "all_gather":
            t = kwargs.get("tensor", args[1] if len(args) > 1 else None)
        elif name == "reduce_scatter":
            t = kwargs.get("input_list", args[1] if len(args) > 1 else None)
        elif name == "all_to_all_single":
            t = kwargs.get("input", args[1] if len(args) > 1 else None)
        else:
            t = kwargs.get("tensor", args[0] if args else None)
        size = (sum(x.numel() * x.element_size() for x in t) if isinstance(t, (list, tuple))
                else t.numel() * t.element_size() if t is not None else 0)
        self.add(size, None if group is None else tuple(dist.get_process_group_ranks(group)))

    def add(self, size: int, ranks: Optional[tuple] = None) -> None:
        """Count a collective: ``size`` bytes handed over in the group of ``ranks`` (default: the world); what the
        wrapped functions call, and what one made outside them calls (torchft's Manager: tools/peers.py)."""
        ranks = tuple(range(dist.get_world_size())) if ranks is None else ranks
        self.bytes += size
        self.calls += 1
        self.by_group[ranks] = self.by_group.get(ranks, 0) + size
        if self.log is not None:
            self.log.append((ranks, size))

    def _wrap(self, owner, attr, name):
        real = getattr(owner, attr)

        def call(*args, **kwargs):
            self._count(name, args, kwargs)
            return real(*args, **kwargs)

        self._saved.append((owner, attr, real))
        setattr(owner, attr, call)

    def __enter__(self):
        for name in self.FUNCTIONS:
            if hasattr(dist, name):
                self._wrap(dist, name, name)
        backend = comm_backend()  # DeepSpeed's, if loaded (its internals: commhooks.deepspeed._compat)
        for attr, name in (("reduce_scatter_function", "reduce_scatter_tensor"),
                           ("all_gather_function", "all_gather_into_tensor")):
            if getattr(backend, attr, None) is not None:
                self._wrap(backend, attr, name)
        return self

    def __exit__(self, *exc):
        for owner, attr, real in reversed(self._saved):
            setattr(owner, attr, real)
        self._saved = []
        return False


def iface_bytes(iface: Optional[str]) -> Optional[Dict[str, int]]:
    """``{"tx": .., "rx": ..}`` of a network interface of this namespace, or None."""
    if not iface:
        return None
    stats = Path("/sys/class/net") / iface / "statistics"
    return {k: int((stats / f"{k}_bytes").read_text()) for k in ("tx", "rx")}
