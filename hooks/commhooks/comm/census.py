"""After a collective times out: which peers are still there, asked through the rendezvous store.

A gloo timeout says only "Operation timed out!": not whether a peer died, stalled, or is cut off, nor which.
The store torchrun (or ``init_distributed``) rendezvoused through is another TCP connection, to rank 0's
host: each rank that timed out posts a key there and looks, for a few seconds, for its group's others.

* A peer that posts too timed out as well: it is alive and reaches the store.
* A peer that does not post within the wait is named: stopped (SIGSTOP, a hung host), dead, or cut off.
* A rank that cannot post at all cannot reach rank 0's host either: its own link (or that host) is down.

Read the names from several ranks together: on a node whose link is down, the ranks say they cannot reach
the store, and the ranks elsewhere name that node's ranks.  Costs nothing until a timeout; then at most
``wait_s`` before the error is raised.  Without a default store (Horovod; a group made without one) it
says nothing.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Sequence

import torch.distributed as dist

def census(global_ranks: Sequence[int], key: str, wait_s: float = 3.0) -> str:
    """A clause for the timeout's error message, naming the peers that did not answer (or "" if unknown).

    Runs on a helper thread joined after ``wait_s`` plus a second: a store call on a link that is down can wait
    for the TCP connection rather than for the store's timeout, and this must never hang."""
    found = []
    helper = threading.Thread(target=lambda: found.append(_count(global_ranks, key, wait_s)), daemon=True,
                              name="commhooks-census")
    helper.start()
    helper.join(wait_s + 1.0)
    if found:
        return found[0]
    return (f"; this rank could not reach the rendezvous store (rank 0's host) within {wait_s + 1.0:g} s either: "
            "its own link, or that host, is likely down")


def _count(global_ranks: Sequence[int], key: str, wait_s: float) -> str:
    try:
        store = dist.distributed_c10d._get_default_store()  # torch's rendezvous store (a private accessor)
        me = dist.get_rank()
    except Exception:  # noqa: BLE001 - no store, no census
        return ""
    slot = f"commhooks/census/{key}/{{}}".format  # ``key``: the group and its timeouts so far, alike on its ranks
    previous = store.timeout
    try:
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        try:
            store.set(slot(me), "timed out")
        except Exception:  # noqa: BLE001 - the store is out of reach
            return ("; this rank cannot reach the rendezvous store (rank 0's host) either: its own link, or that "
                    "host, is likely down")
        missing = [r for r in global_ranks if r != me]
        deadline = time.monotonic() + wait_s
        try:
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not store.check([slot(r)])]
                time.sleep(0.1)
        except Exception:  # noqa: BLE001
            return "; the rendezvous store stopped answering while the peers were counted"
    finally:
        store.set_timeout(previous)  # the store serves the process's later rendezvous too
    if missing:
        return (f"; rank(s) {missing} did not answer through the rendezvous store within {wait_s:g} s of this "
                "rank's timeout either (stopped, dead or cut off), the group's other ranks did")
    return "; every rank of the group answered through the rendezvous store: the collective's own connections failed"
