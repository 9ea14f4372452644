"""Measuring traffic the same way for every method: payload handed to torch.distributed, and bytes on the wire.

:class:`PayloadCounter` wraps ``torch.distributed.all_reduce`` / ``broadcast``
for the duration of a ``with`` block, so torch's own hooks (fp16, PowerSGD,
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


class PayloadCounter:
    """Counts payload bytes and calls of ``dist.all_reduce`` and ``dist.broadcast`` (the latter at its source)."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._saved = None

    def __enter__(self):
        real_all_reduce, real_broadcast = dist.all_reduce, dist.broadcast

        def all_reduce(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return real_all_reduce(tensor, *args, **kwargs)

        def broadcast(tensor, src, *args, **kwargs):
            if dist.get_rank() == src:
                self.bytes += tensor.numel() * tensor.element_size()
                self.calls += 1
            return real_broadcast(tensor, src, *args, **kwargs)

        self._saved = (real_all_reduce, real_broadcast)
        dist.all_reduce, dist.broadcast = all_reduce, broadcast
        return self

    def __exit__(self, *exc):
        dist.all_reduce, dist.broadcast = self._saved
        return False


def iface_bytes(iface: Optional[str]) -> Optional[Dict[str, int]]:
    """``{"tx": .., "rx": ..}`` of a network interface of this namespace, or None."""
    if not iface:
        return None
    stats = Path("/sys/class/net") / iface / "statistics"
    return {k: int((stats / f"{k}_bytes").read_text()) for k in ("tx", "rx")}
