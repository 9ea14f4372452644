"""``Comm`` over ``torch.distributed`` (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import datetime
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from .base import Comm, Group

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class TorchComm(Comm):
    """Collectives on an initialised ``torch.distributed`` process group.

    ``process_group`` (default: the world) is the set of ranks this Comm
    spans; ranks given to :meth:`new_group` are indices *within* it, mapped
    to global ranks for ``dist.new_group``.
    """

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, timeout_s: Optional[float] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group "
                "(or commhooks.launch.init_distributed) before building a commhooks state"
            )
        self.process_group = process_group or dist.group.WORLD
        self._global_ranks = dist.get_process_group_ranks(self.process_group)
        super().__init__(dist.get_rank(self.process_group), dist.get_world_size(self.process_group), timeout_s)

    def _world_handle(self) -> Any:
        return self.process_group

    def _wait(self, work) -> None:
        if self.timeout_s is None:
            work.wait()
        elif not work.wait(timeout=datetime.timedelta(seconds=self.timeout_s)):
            raise TimeoutError(f"no answer within {self.timeout_s:g} s")

    def _allreduce_flat(self, flat: torch.Tensor, op: str, group: Group, async_op: bool):
        # always async, so a blocking call can wait with this Comm's timeout
        work = dist.all_reduce(flat, op=_OPS[op], group=group.handle, async_op=True)
        if not async_op:
            self._wait(work)
            return (lambda: None), None
        return (lambda: self._wait(work)), work.get_future()

    def _broadcast_flat(self, flat: torch.Tensor, src: int, group: Group) -> None:
        self._wait(dist.broadcast(flat, src=self._global_ranks[src], group=group.handle, async_op=True))

    def _allgather_flat(self, flat: torch.Tensor, group: Group):
        out = flat.new_empty(flat.numel() * group.size)
        # torch 2.13 renamed all_gather_into_tensor (now a deprecated alias, a FutureWarning) to all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, flat, group=group.handle, async_op=True)
        return lambda: (self._wait(work), out)[1]

    def notify_join(self, joinable) -> None:
        """``Join.notify_join_context``: an allreduce only if ``joinable`` is the first in the Join context."""
        from torch.distributed.algorithms.join import Join

        work = Join.notify_join_context(joinable)
        if work is not None:
            self._wait(work)

    def _make_group(self, ranks: Tuple[int, ...]) -> Any:
        timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
        return dist.new_group([self._global_ranks[r] for r in ranks], timeout=timeout)
