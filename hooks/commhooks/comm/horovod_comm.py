"""``Comm`` over Horovod: ``hvd.allreduce_async_`` / ``hvd.broadcast_`` with process sets for groups."""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Tuple

import torch

from ..config import ConfigError
from .base import Comm, Group


class HorovodComm(Comm):
    """Collectives through an initialised Horovod (``hvd.init()`` done).

    Groups are Horovod process sets: a static one with the same ranks (from
    ``hvd.init(process_sets=[...])``, see :func:`commhooks.horovod.init`) is
    reused, otherwise one is added dynamically (needs
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``hvd.init(process_sets="dynamic")``).
    One-rank groups need no process set (nothing is sent).  Every call gets a
    name ``<group>.<tag>.<n>`` from a per-(group, tag) counter, identical on
    the members of a group, as Horovod's coordinator requires.
    """

    def __init__(self):
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialised: call hvd.init() (or commhooks.horovod.init(config)) first")
        self.hvd = hvd
        self._seq = defaultdict(int)
        super().__init__(hvd.rank(), hvd.size())

    def _world_handle(self) -> Any:
        return self.hvd.global_process_set

    def _name(self, group: Group, kind: str) -> str:
        key = (group.name, kind)
        self._seq[key] += 1
        return f"commhooks.{group.name}.{kind}.{self._seq[key]}"

    def _allreduce_flat(self, flat: torch.Tensor, op: str, group: Group, async_op: bool):
        hvd = self.hvd
        handle = hvd.allreduce_async_(flat, name=self._name(group, "allreduce"), op=hvd.Sum if op == "sum" else hvd.Max,
                                      process_set=group.handle)
        wait = lambda: hvd.synchronize(handle)  # noqa: E731
        if not async_op:
            wait()
            return (lambda: None), None
        return wait, None

    def _broadcast_flat(self, flat: torch.Tensor, src: int, group: Group) -> None:
        self.hvd.broadcast_(flat, root_rank=src, name=self._name(group, "broadcast"), process_set=group.handle)

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
