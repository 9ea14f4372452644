"""GPU rules, checked on a CPU: what an NCCL process group and a GPU's queue would object to.

The CPU suite runs on gloo, which takes CPU tensors, and on CPU tensors, which never stall a queue: two
classes of GPU bug are invisible to it.  :class:`StrictDevices` makes both visible, for code in the
commhooks library (``hooks/commhooks``) only; torch's own and the test's code are left alone:

* **A tensor made on the default device.**  ``torch.tensor([...])`` without ``device=`` lands on the CPU;
  under ``init_process_group("nccl")`` the collective it is handed to refuses it ("No backend type
  associated with device type cpu") on every multi-rank GPU job.  Here any tensor factory called from
  the library without ``device=`` raises :class:`DeviceRuleError` naming the file and line.
* **A host-device synchronisation.**  ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
  ``bool()``/``float()``/``int()`` of a tensor, ``torch.equal``, ``nonzero``, ``.to("cpu")`` each make
  the CPU wait for the GPU's queue to drain.  Each call from the library is counted (``host_reads``,
  with the places in ``where``), so a test can assert how many a step costs.

Use: ``with StrictDevices() as mode: ...; mode.host_reads``.  ``torch.cuda.set_sync_debug_mode`` does the
second job on a real GPU (``make gpu-check``).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

LIBRARY = Path(__file__).resolve().parent.parent / "hooks" / "commhooks"
TOOLS = LIBRARY / "tools"
_TORCH = Path(torch.__file__).resolve().parent
_HERE = Path(__file__).resolve()

FACTORIES = {
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
    torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.empty_strided,
}
HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.equal, torch.Tensor.equal,
    torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.Tensor.unique,
}


class DeviceRuleError(AssertionError):
    """Library code made a tensor without naming its device."""


def library_caller(include_tools: bool = False) -> Optional[str]:
    """``file:line`` of the library frame that made the current torch call, or None if the caller is not the
    library (torch's own code, the tests).  Frames of torch's dispatch machinery and of this file are
    skipped; the first other frame decides."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path == _HERE or _TORCH in path.parents and path.name in ("overrides.py", "_tensor.py", "_device.py"):
            frame = frame.f_back
            continue
        if LIBRARY in path.parents and (include_tools or TOOLS not in path.parents):
            return f"{path.relative_to(LIBRARY.parent)}:{frame.f_lineno}"
        return None
    return None


def _to_host(func, args, kwargs) -> bool:
    """``tensor.to("cpu")``: a device-to-host copy on a GPU.  (A ``.to(device)`` whose device object happens to be
    the CPU in a CPU run is the synced tensors' device, not a host read: only the spelled-out string counts.)"""
    if func is not torch.Tensor.to:
        return False
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(isinstance(t, str) and t.startswith("cpu") for t in targets)


class StrictDevices(TorchFunctionMode):
    """Raise on a library tensor factory without ``device=``; count the library's host reads."""

    def __init__(self, include_tools: bool = False):
        super().__init__()
        self.include_tools = include_tools
        self.host_reads = 0
        self.where: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = library_caller(self.include_tools)
            if where is not None:
                raise DeviceRuleError(
                    f"{where}: torch.{func.__name__}(...) without device=: on a GPU host it lands on the CPU, and an "
                    "NCCL process group refuses it; make it on the synced tensors' device (state.device, comm.device)")
        if func in HOST_READS or _to_host(func, args, kwargs):
            where = library_caller(self.include_tools)
            if where is not None:
                self.host_reads += 1
                self.where[f"{where} {getattr(func, '__name__', func)}"] += 1
        return func(*args, **kwargs)

    def take(self) -> tuple:
        """(host reads since the last take, and where), then reset."""
        out = (self.host_reads, dict(self.where))
        self.host_reads = 0
        self.where.clear()
        return out
