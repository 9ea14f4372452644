"""``Comm`` over ``torch.distributed``: gloo on CPU, NCCL (or ``cuda:gloo``) on GPU, or both in one group.

What differs by backend, and how it is handled here:

* **Which devices a group takes.**  ``init_process_group("nccl")`` makes a group
  with an NCCL backend only: CPU tensors are refused ("No backend type
  associated with device type cpu").  ``init_process_group()`` with no backend
  makes ``cpu:gloo`` and ``cuda:nccl``; ``"cuda:gloo"`` takes CUDA tensors only
  (several ranks on one GPU: how ``make gpu-check`` runs multi-rank paths on a
  single device).  Control tensors go to :attr:`Comm.device`, the synced
  tensors' device, so every one of these works.
* **Means.**  NCCL averages itself (``ReduceOp.AVG``); gloo has no AVG, so the
  base class divides (first for fp16/bf16).
* **Timeouts.**  Gloo's ``Work.wait(timeout)`` returns or raises after the
  timeout, so a blocking call waits with this Comm's ``timeout_s``.  NCCL's does
  not: a ``wait(timeout)`` that expires aborts the communicator, and a plain
  ``wait()`` only makes the current CUDA stream wait (no host stall).  On NCCL
  the bound is the process group's own timeout, enforced by its watchdog
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default: a collective stuck past
  the timeout tears the process down with an error naming it).  Groups this
  Comm creates get ``timeout_s`` as their timeout; the world group has the one
  given to ``init_process_group`` (``commhooks.launch.init_distributed(timeout=)``).
"""

from __future__ import annotations

import atexit
import datetime
import gc
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .base import Comm, Group
from .census import census

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "mean": dist.ReduceOp.AVG}


_TEARDOWN_REGISTERED = False


def _release_before_exit() -> None:
    """At interpreter exit, before torch's modules are torn down: free what reference cycles keep (futures of
    finished collectives and their callbacks hold tensors), then destroy the default process group.

    Without it a plain script (no ``destroy_process_group()``, as most users' and every framework's) sometimes
    died after training in gloo's teardown, "terminate called without an active exception" (rc 134): the
    cycles were freed by gloo's worker threads while the interpreter was shutting down (measured: 6 of 30
    two-rank AB runs under torchrun)."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the process is ending; nothing may stop it now
            pass


def _arrange_teardown() -> None:
    global _TEARDOWN_REGISTERED
    if not _TEARDOWN_REGISTERED:
        atexit.register(_release_before_exit)
        _TEARDOWN_REGISTERED = True


def backend_name(process_group, device: torch.device) -> Optional[str]:
    """``"gloo"``, ``"nccl"``, ... : the backend ``process_group`` uses for tensors on ``device``; None if it has none."""
    try:
        backend = process_group._get_backend(torch.device(device.type))
    except (RuntimeError, AttributeError, ValueError):
        return None
    name = type(backend).__name__.lower()  # ProcessGroupGloo, ProcessGroupNCCL, ...
    return name[len("processgroup"):] if name.startswith("processgroup") else name


class TorchComm(Comm):
    """Collectives on an initialised ``torch.distributed`` process group.

    ``process_group`` (default: the world) is the set of ranks this Comm
    spans; ranks given to :meth:`new_group` are indices *within* it, mapped
    to global ranks for ``dist.new_group``.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, timeout_s: Optional[float] = None,
                 device: Optional[torch.device] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group "
                "(or commhooks.launch.init_distributed) before building a commhooks state"
            )
        _arrange_teardown()
        self.process_group = process_group or dist.group.WORLD
        self._global_ranks = dist.get_process_group_ranks(self.process_group)
        self._backends: Dict[Tuple[int, str], Optional[str]] = {}
        self._timeouts: Dict[str, int] = {}  # per group: timeouts so far (the census's keys)
        super().__init__(dist.get_rank(self.process_group), dist.get_world_size(self.process_group), timeout_s,
                         device)

    def _world_handle(self) -> Any:
        return self.process_group

    def _default_device(self) -> torch.device:
        """The CPU if the group takes CPU tensors (gloo, or ``cpu:gloo,cuda:nccl``), else the current CUDA device
        (until the first tensors handed to this Comm name theirs: :attr:`Comm.device`)."""
        if backend_name(self.process_group, torch.device("cpu")) is not None or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _backend(self, group: Group, device: torch.device) -> Optional[str]:
        key = (id(group.handle), device.type)
        if key not in self._backends:
            self._backends[key] = backend_name(group.handle or self.process_group, device)
        return self._backends[key]

    def _timeout_words(self, group: Group) -> str:
        if self._backend(group, self.device) == "nccl":
            return " (bounded by the process group's timeout, enforced by NCCL's watchdog)"
        return super()._timeout_words(group)

    def _wait(self, work, group: Group, device: torch.device) -> None:
        """Wait for ``work`` with this Comm's timeout where ``Work.wait(timeout)`` returns on one (gloo); NCCL's
        watchdog aborts instead."""
        if self.timeout_s is None or self._backend(group, device) == "nccl":
            work.wait()  # NCCL: the current stream waits, the host goes on; the watchdog bounds it
            return
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # gloo: "Operation timed out!"; a peer's death is another error, raised as is
            if "timed out" not in str(exc).lower():
                raise
            raise TimeoutError(f"{exc}{self._who_answered(group)}") from exc
        if not done:
            raise TimeoutError(f"no answer within {self.timeout_s:g} s{self._who_answered(group)}")

    def _who_answered(self, group: Group) -> str:
        """The peers that did not answer, named through the rendezvous store (:mod:`.census`, a few seconds)."""
        self._timeouts[group.name] = seen = self._timeouts.get(group.name, 0) + 1  # the same count on its ranks
        return census([self._global_ranks[r] for r in group.ranks], f"{group.name}/{seen}",
                      wait_s=min(3.0, self.timeout_s))

    def _native_mean(self, flat: torch.Tensor, group: Group) -> bool:
        return self._backend(group, flat.device) == "nccl"  # ReduceOp.AVG (NCCL >= 2.10); gloo has none

    def _allreduce_flat(self, flat: torch.Tensor, op: str, group: Group, async_op: bool,
                        key: Optional[str] = None):
        # always async, so a blocking call can wait with this Comm's timeout
        work = dist.all_reduce(flat, op=_OPS[op], group=group.handle, async_op=True)
        if not async_op:
            self._wait(work, group, flat.device)
            return (lambda: None), None
        return (lambda: self._wait(work, group, flat.device)), work.get_future()

    def _broadcast_flat(self, flat: torch.Tensor, src: int, group: Group) -> None:
        self._wait(dist.broadcast(flat, src=self._global_ranks[src], group=group.handle, async_op=True), group,
                   flat.device)

    def _allgather_flat(self, flat: torch.Tensor, group: Group):
        out = flat.new_empty(flat.numel() * group.size)
        # torch 2.13 renamed all_gather_into_tensor (now a deprecated alias, a FutureWarning) to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, flat, group=group.handle, async_op=True)
        return lambda: (self._wait(work, group, flat.device), out)[1]

    def _alltoall_flat(self, flat: torch.Tensor, group: Group):
        out = torch.empty_like(flat)
        work = dist.all_to_all_single(out, flat, group=group.handle, async_op=True)  # gloo (CPU) and NCCL both
        return lambda: (self._wait(work, group, flat.device), out)[1]

    def notify_join(self, joinable) -> None:
        """``Join.notify_join_context``: an allreduce only if ``joinable`` is the first in the Join context."""
        from torch.distributed.algorithms.join import Join

        work = Join.notify_join_context(joinable)
        if work is not None:
            self._wait(work, self.world, self.device)

    def _make_group(self, ranks: Tuple[int, ...]) -> Any:
        if len(ranks) == 1:
            return None  # one-rank groups never communicate (the collectives return first): no process group
        timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
        handle = dist.new_group([self._global_ranks[r] for r in ranks], timeout=timeout)
        device = self.device  # its backend for the synced tensors' device, looked up now rather than at a sync
        self._backends[(id(handle), device.type)] = backend_name(handle, device)
        return handle
