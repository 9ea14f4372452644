"""``Comm`` over Horovod: ``hvd.allreduce_async_`` / ``hvd.broadcast_`` with process sets for groups."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Optional, Tuple

import torch

from ..settings import ConfigError
from .base import Comm, Group


class HorovodComm(Comm):
    """Collectives through an initialised Horovod (``hvd.init()`` done).

    Groups are Horovod process sets: a static one with the same ranks (from
    ``hvd.init(process_sets=[...])``, see :func:`commhooks.horovod.init`) is
    reused, otherwise one is added dynamically (needs
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``hvd.init(process_sets="dynamic")``).
    One-rank groups need no process set (nothing is sent).

    Names: Horovod pairs a call across ranks by its name, and caches the
    negotiation of a (name, shape, dtype, op) it has seen, so a name that
    repeats every step skips the coordinator round-trip.  A call that says
    what it reduces (``key``: the parameter names of a gradient) is named
    ``commhooks.<group>.<kind>.<key>``: gradient hooks fire in whatever order
    autograd runs them, which can differ between ranks, and two same-shaped
    parameters must never be averaged with each other (Horovod's own
    optimizer names its reductions by parameter for the same reason).  Other
    calls (syncs, checks: issued in program order, the same on every rank) are
    named ``commhooks.<group>.<kind>.<dtype>.<numel>.<i>``, where ``i`` is the
    lowest index not in flight for that key: every step's calls get the same
    names (the cache hits) and calls of one shape in flight together differ.

    Waits: Horovod's ``synchronize`` spins on ``sched_yield`` until its
    background thread has done the work.  With a core per rank that costs
    nothing; with more ranks than cores (CPU jobs, tests, a node shared with
    data loaders) the spinning main threads take the cores the background
    threads need, and a 12-step job on 4 ranks / 2 cores took minutes
    instead of seconds.  So a wait polls (``hvd.poll``) with a sleep that
    doubles from 10 us up to 1 ms, then calls ``synchronize`` (which
    returns at once, or raises the collective's error): at most ~1 ms
    added to a collective that lasted longer than that.

    Means: ``hvd.Average`` (Horovod sums, then scales); fp16 is scaled by
    ``1/size`` before the sum (``prescale_factor``), so it cannot overflow.
    """

    def __init__(self):
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialised: call hvd.init() (or commhooks.horovod.init(config)) first")
        self.hvd = hvd
        self._inflight = defaultdict(set)  # key -> indices of calls not yet waited on
        super().__init__(hvd.rank(), hvd.size())

    def _world_handle(self) -> Any:
        return self.hvd.global_process_set

    def _claim(self, group: Group, kind: str, flat: torch.Tensor, what: Optional[str] = None) -> Tuple[tuple, int, str]:
        key = (group.name, kind, what) if what is not None else (
            group.name, kind, str(flat.dtype).replace("torch.", ""), flat.numel())
        taken = self._inflight[key]
        i = next(j for j in range(len(taken) + 1) if j not in taken)
        taken.add(i)
        return key, i, "commhooks." + ".".join(map(str, key)) + (f".{i}" if what is None or i else "")

    def _native_mean(self, flat: torch.Tensor, group: Group) -> bool:
        return True  # hvd.Average, or a prescaled sum for fp16

    def _allreduce_flat(self, flat: torch.Tensor, op: str, group: Group, async_op: bool,
                        key: Optional[str] = None):
        hvd = self.hvd
        kwargs = {"op": {"sum": hvd.Sum, "max": hvd.Max, "mean": hvd.Average}[op]}
        if op == "mean" and flat.dtype == torch.float16:  # divide before the sum, as DDP's default hook does
            kwargs = {"op": hvd.Sum, "prescale_factor": 1.0 / group.size}
        wait = self._started(f"allreduce-{op}", hvd.allreduce_async_, flat, group, key, **kwargs)
        if not async_op:
            wait()
            return (lambda: None), None
        return wait, None

    def _synchronize(self, handle):
        """``hvd.synchronize(handle)`` without its spin: poll, sleeping 10 us doubling to 1 ms (see the class)."""
        pause = 1e-5
        while not self.hvd.poll(handle):
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        return self.hvd.synchronize(handle)

    def _broadcast_flat(self, flat: torch.Tensor, src: int, group: Group) -> None:
        self._started(f"broadcast-{src}", self.hvd.broadcast_async_, flat, group, root_rank=src)()

    def _allgather_flat(self, flat: torch.Tensor, group: Group):
        # Horovod's allgather carries any dtype, int8 and raw bytes included (its allreduce refuses those)
        return self._started("allgather", self.hvd.allgather_async, flat, group)

    def _alltoall_flat(self, flat: torch.Tensor, group: Group):
        # equal splits (splits=None): piece j of the first dimension to member j; newer Horovods' synchronize gives
        # (output, received splits)
        wait = self._started("alltoall", self.hvd.alltoall_async, flat, group)
        return lambda: (lambda out: out[0] if isinstance(out, (tuple, list)) else out)(wait())

    def _started(self, kind: str, start, flat: torch.Tensor, group: Group, what: Optional[str] = None, **kwargs):
        """Start Horovod's ``start(flat, name=, process_set=, **kwargs)`` under a claimed name (``what``: see
        :meth:`_claim`); the function that waits (:meth:`_synchronize`) and frees the name."""
        key, i, name = self._claim(group, kind, flat, what)
        try:
            handle = start(flat, name=name, process_set=group.handle, **kwargs)
        except Exception:
            self._inflight[key].discard(i)
            raise

        def wait():
            try:
                return self._synchronize(handle)
            finally:
                self._inflight[key].discard(i)

        return wait

    def _make_group(self, ranks: Tuple[int, ...]) -> Any:
        if len(ranks) == 1:
            return None  # one-rank groups never communicate
        from horovod.common import process_sets

        for set_id, set_ranks in process_sets._basics._get_process_set_ids_and_ranks().items():
            if tuple(set_ranks) == ranks:
                return process_sets._temp_process_set_object(set_id)
        try:
            return self.hvd.add_process_set(list(ranks))
        except Exception as exc:  # static process sets only
            raise ConfigError(
                f"no Horovod process set for ranks {list(ranks)}: start Horovod with "
                "commhooks.horovod.init(config) (static sets for the AB groups), or with "
                f"HOROVOD_DYNAMIC_PROCESS_SETS=1 ({type(exc).__name__}: {exc})"
            ) from None
