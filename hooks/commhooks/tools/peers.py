"""The peers a user would pick instead, run by their own code: torchft's ``LocalSGD`` and ``DiLoCo`` (Streaming
DiLoCo with fragments, a sync delay and mixing), as torchft's examples build them, for ``commhooks bench``.

Each rank is one torchft replica (a replica group of one process): its own ``Manager`` over a ``ProcessGroupGloo``,
its own store, all of them in one quorum of a ``LighthouseServer`` that rank 0 runs for the run and whose address it
hands the others over the job's process group.  The training loop is the trainer's, inside torchft's context
manager, exactly as torchft's ``train_diloco.py`` does it; nothing of commhooks' algorithms is involved.

Bytes are counted as for every other method (what a rank hands to a collective): each ``Manager.allreduce`` adds
its tensor's bytes to the trainer's payload counter.  Syncs: each commit the method asks for (LocalSGD: one per
sync; DiLoCo: one per fragment's sync).

Settings (DiLoCo, arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512): the outer optimizer is SGD with lr 0.7,
Nesterov momentum 0.9, the papers'; ``sync_every`` is the run's choice (``--peer-sync-every``): torchft's examples
use 20 and more, the bench runs each peer also at commhooks' sync count.  torchft's quantized path
(``should_quantize``) needs Triton and a GPU: not run here, so the peers send fp32.

Loopback only: torchft's Manager names this host by its hostname, which the benchmark's network namespaces do not
resolve; a run in namespaces is refused.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import List

import torch
import torch.distributed as dist
from torch import nn

PEERS = ("torchft-localsgd", "torchft-diloco")


class PeerRun:
    """One rank of a torchft peer: the Manager, torchft's LocalSGD or DiLoCo around the model, the Lighthouse on
    rank 0; a context manager the training loop runs inside (as torchft's own examples do)."""

    def __init__(self, kind: str, model: nn.Module, optimizer: torch.optim.Optimizer, sync_every: int,
                 fragments: int = 1, delay: int = 0, alpha: float = 0.0, timeout_s: float = 120.0):
        from torchft import Manager, ProcessGroupGloo
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo, LocalSGD

        if kind not in PEERS:
            raise ValueError(f"unknown peer {kind!r}; choose from {', '.join(PEERS)}")
        if os.environ.get("COMMHOOKS_WIRE_IFACE"):
            raise ValueError(f"{kind}: torchft's peers run on loopback only (its Manager names this host by its "
                             "hostname, which the benchmark's network namespaces do not resolve): --netns off")
        rank, world = dist.get_rank(), dist.get_world_size()
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world) if rank == 0 else None
        address = [self.lighthouse.address() if self.lighthouse is not None else None]
        dist.broadcast_object_list(address, src=0)
        # this replica's own store (a replica of one rank: the job's shared one would let the replicas' Managers
        # overwrite each other's address), alive as long as the run
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        host, port = "127.0.0.1", self.store.port
        timeout = timedelta(seconds=timeout_s)
        self.counter = None  # the trainer's payload counter (set before the loop)
        self.syncs = 0
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, use_async_quorum=False,
            load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
            state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
            replica_id=f"rank{rank}", store_addr=host, store_port=port, rank=0, world_size=1,
            lighthouse_addr=address[0], timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout)
        self._meter_the_manager()
        if kind == "torchft-localsgd":
            self.method = LocalSGD(self.manager, model, optimizer, sync_every=sync_every)
        else:
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            self.method = DiLoCo(self.manager, fragments_of(model, fragments), optimizer, outer,
                                 sync_every=sync_every, fragment_sync_delay=delay, fragment_update_alpha=alpha)

    def _meter_the_manager(self) -> None:
        """Count what each ``allreduce`` hands over (its tensor's bytes) and each sync's commit (a fragment's)."""
        allreduce, should_commit = self.manager.allreduce, self.manager.should_commit

        def metered_allreduce(tensor, *args, **kwargs):
            if self.counter is not None:
                self.counter.add(tensor.numel() * tensor.element_size())
            return allreduce(tensor, *args, **kwargs)

        def counted_commit(*args, **kwargs):
            self.syncs += 1
            return should_commit(*args, **kwargs)

        self.manager.allreduce, self.manager.should_commit = metered_allreduce, counted_commit

    def __enter__(self) -> "PeerRun":
        self.method.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.method.__exit__(*exc)
        finally:
            self.manager.shutdown(wait=False)
            dist.barrier()  # every replica has left the quorum before the Lighthouse goes
            if self.lighthouse is not None:
                self.lighthouse.shutdown()


def fragments_of(model: nn.Module, count: int) -> List[nn.Module]:
    """The model's top-level children (a block list's blocks one by one) in ``count`` contiguous groups of about
    equal parameter count (torchft syncs a fragment's parameters together); the groups share the model's
    parameters, nothing is copied."""
    children = []
    for child in model.children():  # a block list counts block by block, so that fragments can split it
        children += list(child.children()) if isinstance(child, (nn.ModuleList, nn.Sequential)) else [child]
    children = [c for c in children if any(True for _ in c.parameters())]
    own = [p for p in model.parameters(recurse=False)]
    if count == 1 or len(children) < count:
        return [model]
    total = sum(p.numel() for p in model.parameters())
    groups: List[List[nn.Module]] = [[]]
    seen = 0
    for child in children:
        if seen >= total * len(groups) / count and len(groups) < count:
            groups.append([])
        groups[-1].append(child)
        seen += sum(p.numel() for p in child.parameters())
    fragments = [nn.ModuleList(g) for g in groups]
    if own:  # parameters held by the model itself go with the first fragment
        holder = nn.Module()
        for i, p in enumerate(own):
            holder.register_parameter(f"p{i}", p)
        fragments[0].append(holder)
    return fragments

