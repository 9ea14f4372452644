"""One heal plan per replica group: every rank of a group heals from (and serves) what its rank 0 was told.

torchft 0.2.0 answers each rank's quorum request with a recovery assignment of that rank's own: among the live groups
it picks ``(i + group_rank) % live`` (and, at a fresh start, a primary ``group_rank % groups``), which spreads a
heal's load over the live groups.  That is right for torchft's own use, where every group holds the same state at
every step.  It is wrong for local methods, where each group's optimizer moments (and, at a fresh start, its
weights) are its own: a group of several ranks then heals rank 0 from one group and rank 1 from another, and under
DDP its ranks train different models from there on, with no error (the same at a fresh start of groups seeded
apart).

:class:`GroupHealPlan` wraps the Manager's client: each rank asks for its quorum as torchft does, then takes group
rank 0's recovery fields (``heal``, the source's manager address and replica rank, the ranks to serve), which rank 0
hands the group through the group's store.  Every rank ``i`` of a healing group then fetches rank ``i``'s state of
the same live group, and every rank of that group serves it (torchft fetches rank ``i``'s part from the source's
Manager by the fetching rank's own rank, so shards, under FSDP2, stay matched).  The rest of the answer (the quorum,
its store, the replica ranks) is torchft's, untouched.

Each answer also records what the adapter needs to know of the quorum (:class:`QuorumNews`): whether this group
heals, and whether a group it did not meet in its last quorum is in it (a newcomer, healed or at a fresh start:
every group then checks that they share one config).

What it reaches into: the Manager's ``_client`` (its quorum calls) and ``_store`` (the group's store), which torchft
0.2.0 has; another torchft is refused here with a clear error rather than healed per rank.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import List, Optional, Tuple

from .settings import ConfigError

#: the recovery fields every rank takes from its group's rank 0
RECOVERY_FIELDS = ("heal", "recover_src_manager_address", "recover_src_replica_rank", "recover_dst_replica_ranks")


@dataclasses.dataclass
class QuorumNews:
    """What one quorum meant for this group: ``heals`` (it copies a live group's state, from the group at replica
    rank ``source``), ``newcomers`` (a group this one did not meet in its previous quorum takes part), ``members``
    (the groups' replica ids, in quorum rank order)."""

    heals: bool = False
    source: Optional[int] = None
    newcomers: bool = False
    members: Tuple[str, ...] = ()
    me: Optional[str] = None  # this group's replica id (torchft's: the id given, ``:`` and a uuid of this start)


class GroupHealPlan:
    """A stand-in for a Manager's client whose recovery fields are the group's rank 0's (see the module)."""

    def __init__(self, client, store, group_rank: int, group_size: int):
        self._client, self._store = client, store
        self.group_rank, self.group_size = group_rank, group_size
        self.news = QuorumNews()
        self._asked = 0  # quorum requests so far: every rank of a group makes the same ones, in the same order
        self._met: Tuple[str, ...] = ()

    def __getattr__(self, name):  # everything else is the client's (should_commit, _checkpoint_metadata)
        return getattr(self._client, name)

    def _quorum(self, **request):
        """torchft's quorum answer for this rank, with group rank 0's recovery fields."""
        result = self._client._quorum(**request)
        self._asked += 1
        if self.group_size > 1:
            key = f"commhooks/heal-plan/{self._asked}"
            if self.group_rank == 0:
                self._store.set(key, json.dumps({f: getattr(result, f) for f in RECOVERY_FIELDS}))
                if self._asked > 1:  # every rank read the previous one before asking for this quorum
                    self._store.delete_key(f"commhooks/heal-plan/{self._asked - 1}")
            else:
                self._store.wait([key], request.get("timeout", timedelta(seconds=300)))
                for field, value in json.loads(self._store.get(key)).items():
                    setattr(result, field, value)
        members = tuple(result.replica_ids)
        mine = members[result.replica_rank] if 0 <= result.replica_rank < len(members) else None
        self.news = QuorumNews(heals=bool(result.heal),
                               source=result.recover_src_replica_rank if result.heal else None,
                               newcomers=bool(set(members) - set(self._met) - {mine}), members=members, me=mine)
        self._met = members
        return result


def plan_heals_by_group(manager, group_rank: int, group_size: int) -> GroupHealPlan:
    """Put a :class:`GroupHealPlan` between ``manager`` and its client (once; every rank of the group, before its
    first quorum); returns it."""
    client, store = getattr(manager, "_client", None), getattr(manager, "_store", None)
    if isinstance(client, GroupHealPlan):
        return client
    if client is None or store is None or not hasattr(client, "_quorum"):
        raise ConfigError("commhooks.torchft: this torchft's Manager has no `_client` with `_quorum` and `_store` "
                          "(torchft 0.2.0 has them): commhooks cannot make a replica group heal from one source "
                          "with it; install torchft==0.2.0 (the `torchft` extra)")
    plan = GroupHealPlan(client, store, group_rank, group_size)
    manager._client = plan
    return plan


def members_named(members: List[str]) -> List[str]:
    """Replica ids as a user gave them (torchft appends ``:<uuid>`` to each start's id)."""
    return [m.split(":")[0] for m in members]
