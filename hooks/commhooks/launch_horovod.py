"""Horovod's Gloo controller under mpirun / mpiexec / srun / torchrun: the part of ``horovodrun`` that commhooks does.

Horovod built without MPI (the usual pip build) learns its rank, size and peers from ``horovodrun``: the
launcher runs a rendezvous HTTP server and gives every rank ``HOROVOD_*`` variables.  Under any other launcher a
plain ``hvd.init()`` would start one separate world per rank.  :func:`bootstrap_gloo` does what horovodrun does,
from the placement :func:`commhooks.launch.discover` found: rank 0 serves Horovod's own rendezvous server
(:func:`_serve_rendezvous`) and each rank gets horovodrun's variables (:func:`gloo_environment`).

It lives here, with the launch code, because it is launch code: it reads the launcher's facts, picks ports,
fills the environment and starts a server thread.  The Horovod adapter (:func:`commhooks.horovod.init`) only
calls it before ``hvd.init()``.  Importing this module neither imports Horovod nor changes the environment.
"""

from __future__ import annotations

import copy
import os

from .launch import LaunchError, fill_rendezvous_with_mpi

_RENDEZVOUS = None  # rank 0's rendezvous server, alive as long as the process


def gloo_environment(placement, addr: str, port: int) -> dict:
    """The variables horovodrun would give this rank for Horovod's Gloo controller.

    Nodes are the launcher's contiguous blocks of ``local_world_size`` ranks
    (named ``node<i>``: the names only key the rendezvous scopes; the network
    interface comes from ``HOROVOD_GLOO_IFACE`` if you set it, else the host name).
    """
    p = placement
    if p.world_size % p.local_world_size:
        raise LaunchError(f"{p.source}: {p.world_size} ranks do not split into nodes of {p.local_world_size}; "
                          "Horovod's Gloo controller needs the same number of ranks on every node")
    return {
        "HOROVOD_HOSTNAME": f"node{p.rank // p.local_world_size}",
        "HOROVOD_RANK": str(p.rank), "HOROVOD_SIZE": str(p.world_size),
        "HOROVOD_LOCAL_RANK": str(p.local_rank), "HOROVOD_LOCAL_SIZE": str(p.local_world_size),
        "HOROVOD_CROSS_RANK": str(p.rank // p.local_world_size),
        "HOROVOD_CROSS_SIZE": str(p.world_size // p.local_world_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
    }


def _serve_rendezvous(placement, port: int):
    """Rank 0: Horovod's own rendezvous HTTP server (what horovodrun runs), on ``port``."""
    import threading

    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    p, local = placement, placement.local_world_size
    plan = [SlotInfo(hostname=f"node{r // local}", rank=r, local_rank=r % local, cross_rank=r // local,
                     size=p.world_size, local_size=local, cross_size=p.world_size // local) for r in range(p.world_size)]
    server = RendezvousHTTPServer(("0.0.0.0", port), RendezvousHandler, 0)
    server.init(plan)
    threading.Thread(target=server.serve_forever, name="commhooks-horovod-rendezvous", daemon=True).start()
    return server


def bootstrap_gloo(placement) -> None:
    """Bring up Horovod's Gloo controller from an mpirun / mpiexec / srun / torchrun environment.

    The rendezvous is rank 0: at ``MASTER_ADDR`` and ``MASTER_PORT + 1`` when
    those are known (torchrun, SLURM: the port derived from the job id, or
    exported), else at rank 0's host and a free port that mpi4py broadcasts
    (Open MPI, MPICH).  Then each rank gets horovodrun's variables.
    """
    global _RENDEZVOUS
    p = copy.copy(placement)
    if p.master_addr is None and p.local_world_size == p.world_size:
        p.master_addr = "127.0.0.1"
    if p.master_port is not None and p.master_addr is not None:
        port = p.master_port + 1
    elif p.source in ("openmpi", "mpich"):
        p.master_port = None
        fill_rendezvous_with_mpi(p)
        port = p.master_port
    else:
        raise LaunchError(f"{p.source} environment without MASTER_ADDR / MASTER_PORT: export them so Horovod's "
                          "rendezvous can be found (it listens at MASTER_PORT + 1 on rank 0)")
    if p.rank == 0:
        _RENDEZVOUS = _serve_rendezvous(p, port)
    os.environ.update(gloo_environment(p, p.master_addr, port))
