"""``commhooks train --backend torchft``: this process is one replica group of a torchft job, or one rank of one.

The fault injector (``commhooks faults --torchft``) starts the groups, and a Lighthouse it runs itself.  A group
of one process gets ``RANK`` / ``WORLD_SIZE``: the group's index and the number of groups.  A group of several
(``--group-ranks``) gets ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` of its own process group
(DDP inside it) and the group's index and the number of groups in :data:`GROUP_VAR` / :data:`GROUPS_VAR`; rank
*i* of a group syncs with rank *i* of the others through its own Manager.  The data shard is the global index
``group * ranks_per_group + rank`` of ``groups * ranks_per_group``.  Each group keeps its own rendezvous store
for its Managers (hosted by its rank 0, made new at each start), joins the quorum in
:func:`commhooks.torchft.register`, and, started again after a crash, heals there from a live group and goes on
from that group's step.  Loopback only: torchft's heal transport names this host by its hostname, which the
benchmark's network namespaces do not resolve.
"""

from __future__ import annotations

import os
from datetime import timedelta

GROUP_VAR, GROUPS_VAR = "COMMHOOKS_LIVE_GROUP", "COMMHOOKS_LIVE_GROUPS"


def placement() -> tuple:
    """(this group's index, the number of groups, this rank in the group, the ranks per group): from
    :data:`GROUP_VAR` / :data:`GROUPS_VAR` and RANK / WORLD_SIZE inside the group where the first is set, else
    from RANK / WORLD_SIZE as the group's index and the number of groups (default: 0 of 1), a group of one."""
    if GROUP_VAR in os.environ:
        return (int(os.environ[GROUP_VAR]), int(os.environ.get(GROUPS_VAR, 1)), int(os.environ.get("RANK", 0)),
                int(os.environ.get("WORLD_SIZE", 1)))
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), 0, 1


def join(args, model, optimizer, scheduler, conf):
    """A torchft Manager for this rank of its group and the commhooks state over it
    (:class:`commhooks.torchft.LiveGroups`); ``model`` is DDP inside a group of several ranks."""
    from torchft import Manager, ProcessGroupGloo

    from .. import torchft as live_adapter
    from ..launch import fresh_store

    if conf is None:
        raise ValueError("--backend torchft needs a commhooks config (--config): it makes the syncs live")
    if not args.lighthouse:
        raise ValueError("--backend torchft needs --lighthouse (or TORCHFT_LIGHTHOUSE): the Lighthouse's address")
    store, host, port = fresh_store()  # new at each start of the group: no dead start's keys
    group, groups, rank, size = placement()
    timeout = timedelta(seconds=conf.timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=1, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=timedelta(seconds=args.quorum_timeout), connect_timeout=timeout, rank=rank,
                      world_size=size, store_addr=host, store_port=port, lighthouse_addr=args.lighthouse,
                      replica_id=f"group{group}")
    # a first start waits for every group (its run then does not depend on which group came up first)
    live = live_adapter.register(model, optimizer, conf, manager, scheduler, wait_for_groups=groups)
    live.store = store  # alive as long as the group
    return live


def leave(live) -> None:
    """After the last step (the state ended its run synced): unhook, leave the quorum."""
    live.close(finish=False)
    live.manager.shutdown(wait=False)
