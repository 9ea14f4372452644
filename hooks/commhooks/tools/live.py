"""``commhooks train --backend torchft``: this process is one replica group of a torchft job.

The fault injector (``commhooks faults --torchft``) starts one per group, with ``RANK`` / ``WORLD_SIZE`` the
group's index and the number of groups (they pick the group's data shard), and a Lighthouse it runs itself.
The group keeps its own rendezvous store (torchft's Manager needs one per group), joins the quorum in
:func:`commhooks.torchft.register`, and, started again after a crash, heals there from a live group and goes on
from that group's step.  Loopback only: torchft's heal transport names this host by its hostname, which the
benchmark's network namespaces do not resolve.
"""

from __future__ import annotations

import os
from datetime import timedelta


def placement() -> tuple:
    """(this group's index, the number of groups), from the launcher's RANK / WORLD_SIZE (default: 0 of 1)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def join(args, model, optimizer, scheduler, conf):
    """A torchft Manager for this group and the commhooks state over it (:class:`commhooks.torchft.LiveGroups`)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    from .. import torchft as live_adapter

    if conf is None:
        raise ValueError("--backend torchft needs a commhooks config (--config): it makes the syncs live")
    if not args.lighthouse:
        raise ValueError("--backend torchft needs --lighthouse (or TORCHFT_LIGHTHOUSE): the Lighthouse's address")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's own
    timeout = timedelta(seconds=conf.timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                      min_replica_size=1, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=timedelta(seconds=args.quorum_timeout), connect_timeout=timeout, rank=0,
                      world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=args.lighthouse, replica_id=f"group{placement()[0]}")
    live = live_adapter.register(model, optimizer, conf, manager, scheduler)
    live.store = store  # alive as long as the group
    return live


def leave(live) -> None:
    """After the last step (the state ended its run synced): unhook, leave the quorum."""
    live.close(finish=False)
    live.manager.shutdown(wait=False)
