"""``Comm`` over a torchft ``Manager``: the world is the replica groups of the current quorum, and it changes.

torchft (its Lighthouse, one ``Manager`` per replica group) decides which replica groups take part in each step
(a *quorum*) and heals a group that joins from a live one.  This Comm is what a commhooks state sends its syncs
through: one member per replica group, rank and size those of the quorum.

* **Means.**  ``Manager.allreduce`` with SUM, divided here by the number of groups that took part.
* **A group lost mid-collective.**  torchft does not raise: it records the error and leaves the tensor
  undefined.  Every collective ends with torchft's vote (``should_commit()``), which the ranks of a replica
  group take together: in a group of several ranks, rank i meets rank i of the other groups, and one rank's
  counterpart may die while another's still answers; the vote gives the group one verdict.  On a failed vote
  this Comm restores the input, asks for a quorum of the survivors only (``start_quorum(shrink_only=True,
  allow_heal=False)``: no group joins in the middle of a sync) and tries again, until ``timeout_s`` has passed
  since the first try (the Lighthouse sees a group gone only after its heartbeat timeout).  Each retry is on
  the survivors: alone, a group's mean is its own.  This assumes every surviving group saw the loss; one that
  completed the collective while another did not (possible from 3 groups, if the lost one died in the last
  exchange) goes on, and the two then fail the next step proof with a DivergenceError on both: an error, never
  a silent difference.  A rank of this group that died makes the vote time out here: the group's launcher
  restarts the whole group, which heals when it joins.
* **Allgather** (compressed payloads) is an allreduce SUM of a buffer with one slot per group (the others
  zero): it carries size x the payload, and survives a shrink, since it is laid out again for the new quorum.
  **All-to-all** (the two-step exchange) is refused: its pieces are cut for a fixed number of groups.
* **Broadcast**: an allreduce SUM where only the source's slot is not zero.

The quorum calls are the adapter's (:mod:`commhooks.torchft`): one after every step that communicated, where a
restarted group is admitted and healed.  :attr:`used` says whether this step sent anything.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Tuple  # noqa: F401

import torch

from .base import CollectiveError, Comm, Group, Groups


class ManagedComm(Comm):
    """Collectives through a torchft ``Manager``; :meth:`requorum` re-reads its rank and size."""

    fixed_world = False

    def __init__(self, manager, timeout_s: Optional[float] = None):
        from torch.distributed import ReduceOp

        self.manager = manager
        self._sum, self._max = ReduceOp.SUM, ReduceOp.MAX
        self.used = False  # a collective went through the manager since the last commit
        self.retries = 0  # collectives tried again on a smaller quorum (a group was lost)
        super().__init__(0, 1, timeout_s)  # one group until the first quorum

    # ------------------------------------------------------------------ the quorum

    def requorum(self, allow_heal: bool = True, shrink_only: bool = False) -> None:
        """A new quorum (torchft heals a group that is behind here, when ``allow_heal``); then this Comm's rank
        and size are the quorum's."""
        self.manager.start_quorum(allow_heal=allow_heal, shrink_only=shrink_only)
        rank = self.manager.participating_rank()
        if rank is None:  # behind the others where no heal was allowed: its syncs would be zeros
            raise CollectiveError("torchft: this replica group is not part of the new quorum (behind the others "
                                  "during a sync, where no group can be healed); restart it: it heals when it joins")
        self._resize(rank, self.manager.num_participants())

    def _resize(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._groups = Groups(rank, size)

    def _make_group(self, ranks: Tuple[int, ...]) -> Any:
        raise CollectiveError("commhooks over torchft: groups inside the quorum are not supported (the quorum "
                              "changes as replica groups come and go); use one rank per replica group")

    # ------------------------------------------------------------------ collectives

    def _native_mean(self, flat: torch.Tensor, group: Group) -> bool:
        return True  # divided here by the groups that took part, which may be fewer than when the call began

    def _reduce(self, flat: torch.Tensor, op: str, layout=None) -> torch.Tensor:
        """Reduce ``flat`` over the quorum, trying again on the survivors after a loss.  ``layout(rank, size)``,
        if given, builds the buffer for a quorum (an allgather's slots) and is reduced instead of ``flat``."""
        saved = flat.clone()
        limit = self.timeout_s or 300.0
        deadline = time.monotonic() + limit
        while True:
            buf = layout(self.rank, self.size) if layout is not None else flat
            if self.size == 1:
                return buf
            work = self.manager.allreduce(buf, should_quantize=False,
                                          reduce_op=self._max if op == "max" else self._sum)
            work.wait()
            self.used = True
            error = self.manager.errored()
            # torchft's vote, which every rank of this replica group takes together: one verdict for the group,
            # so a rank whose counterpart in a lost group died and a rank whose counterpart still answered
            # retry (or go on) alike; a rank of this group that died makes it time out and fail here
            if self.manager.should_commit():
                if op == "mean":
                    buf.div_(self.size)
                return buf
            flat.copy_(saved)  # what torchft left there is undefined
            if time.monotonic() > deadline:
                why = error.original_exception if error is not None else "another rank of this replica group's"
                raise CollectiveError(f"torchft: no quorum completed the collective within {limit:g} s "
                                      f"(last error: {why})")
            self.retries += 1  # the next quorum drops the lost group
            self.requorum(allow_heal=False, shrink_only=True)

    def _allreduce_flat(self, flat: torch.Tensor, op: str, group: Group, async_op: bool,
                        key: Optional[str] = None):
        self._reduce(flat, op)  # blocking: torchft's own futures hide errors until the manager is asked
        return (lambda: None), None

    def _broadcast_flat(self, flat: torch.Tensor, src: int, group: Group) -> None:
        if self.rank != src:
            flat.zero_()
        self._reduce(flat, "sum")

    def _allgather_flat(self, flat: torch.Tensor, group: Group):
        def slots(rank: int, size: int) -> torch.Tensor:
            out = flat.new_zeros(flat.numel() * size)
            out[rank * flat.numel():(rank + 1) * flat.numel()] = flat
            return out

        gathered = self._reduce(flat, "sum", layout=slots)
        return lambda: gathered

    def _alltoall_flat(self, flat: torch.Tensor, group: Group):
        raise CollectiveError("commhooks over torchft: the two-step exchange (an all-to-all) cuts its pieces for a "
                              "fixed number of groups; set payload_exchange to \"allgather\"")
