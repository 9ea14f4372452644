"""Start ``torch.distributed`` from whatever launched the process.

Cluster users start jobs with ``mpirun`` or ``srun``, not ``torchrun``.
:func:`init_distributed` finds rank, world size, local rank and local world
size, in this order, from:

1. an already initialised process group (reused as is);
2. torchrun / the deepspeed launcher: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``; horovodrun: ``HOROVOD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
3. Open MPI: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
4. MPICH / Intel MPI: ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``;
5. SLURM: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, and the tasks
   on this node from ``SLURM_NTASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE``.

The rendezvous address is ``MASTER_ADDR`` if set, else the first host of
``SLURM_JOB_NODELIST`` under SLURM, else 127.0.0.1 when every rank is on one
node, else rank 0's host name sent by mpi4py.  The port is ``MASTER_PORT`` if
set; else under MPI rank 0 picks a free port and mpi4py broadcasts it (under
horovodrun, once ``hvd.init()`` ran, Horovod broadcasts it); under
SLURM without MPI it is derived from ``SLURM_JOB_ID`` (the same on every rank).
The variables torch, Horovod and DeepSpeed read (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are set
before ``init_process_group``.  A missing or inconsistent variable raises
:class:`LaunchError` naming it, on every rank whose environment is broken.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import inspect
import os
import re
import socket
from typing import List, Mapping, Optional

import torch
import torch.distributed as dist


class LaunchError(RuntimeError):
    """The launcher's environment is missing a variable or contradicts itself."""


@dataclasses.dataclass
class Placement:
    """Where this process sits in the job, and who found out."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    source: str  # "torchrun", "openmpi", "mpich", "slurm", "initialised"
    master_addr: Optional[str] = None
    master_port: Optional[int] = None


# (source, rank, size, local rank, local size)
_MPI_STYLE = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _int(env: Mapping[str, str], key: str, source: str) -> int:
    if key not in env:
        raise LaunchError(f"{source} environment detected but {key} is missing")
    try:
        return int(env[key])
    except ValueError:
        raise LaunchError(f"{key} must be an integer, got {env[key]!r}") from None


def parse_nodelist(nodelist: str) -> List[str]:
    """Expand a SLURM node list: ``node[01-04,07],gpu3`` -> node01 .. node04, node07, gpu3 (python-hostlist).

    Zero padding is kept; several bracket groups in one name (``r[1-2]n[3,5]``)
    expand as a product.
    """
    import hostlist

    try:
        return hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise LaunchError(f"SLURM_JOB_NODELIST {nodelist!r} cannot be expanded: {exc}") from None


def parse_tasks_per_node(spec: str) -> List[int]:
    """Expand ``SLURM_TASKS_PER_NODE``: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: List[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise LaunchError(f"SLURM_TASKS_PER_NODE has a bad entry {part!r} in {spec!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _slurm(env: Mapping[str, str]) -> Placement:
    src = "SLURM"
    rank, size, local = (_int(env, k, src) for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    if "SLURM_NTASKS_PER_NODE" in env:
        local_size = _int(env, "SLURM_NTASKS_PER_NODE", src)
    elif "SLURM_TASKS_PER_NODE" in env:
        counts = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        node = _int(env, "SLURM_NODEID", src) if len(counts) > 1 else 0
        if node >= len(counts):
            raise LaunchError(f"SLURM_NODEID {node} is outside SLURM_TASKS_PER_NODE {env['SLURM_TASKS_PER_NODE']!r}")
        local_size = counts[node]
    else:
        raise LaunchError("SLURM environment detected but SLURM_NTASKS_PER_NODE and SLURM_TASKS_PER_NODE are missing")
    addr = env.get("MASTER_ADDR")
    if addr is None:
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST"))
        if nodelist is None:
            raise LaunchError("SLURM environment detected but SLURM_JOB_NODELIST is missing (and MASTER_ADDR is not set)")
        addr = parse_nodelist(nodelist)[0]
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None
    if port is None and "SLURM_JOB_ID" in env:
        port = 20000 + int(env["SLURM_JOB_ID"]) % 20000  # same on every rank of the job, no communication
    return Placement(rank, size, local, local_size, "slurm", addr, port)


def discover(env: Optional[Mapping[str, str]] = None) -> Optional[Placement]:
    """Read the placement from the launcher's variables; ``None`` if no launcher is recognised."""
    env = os.environ if env is None else env
    placement = None
    for source, rank_key, size_key, local_key, local_size_key in _MPI_STYLE:
        if rank_key in env:
            rank, size = _int(env, rank_key, source), _int(env, size_key, source)
            if source == "torchrun":  # plain RANK/WORLD_SIZE scripts often omit the local pair
                local = int(env.get(local_key, 0))
                local_size = int(env.get(local_size_key, size))
            elif local_key not in env and "SLURM_PROCID" in env:
                break  # srun --mpi=pmi2 sets PMI_RANK but not the local pair: SLURM knows it
            else:
                local, local_size = _int(env, local_key, source), _int(env, local_size_key, source)
            port = env.get("MASTER_PORT")
            placement = Placement(rank, size, local, local_size, source, env.get("MASTER_ADDR"),
                                  int(port) if port else None)
            break
    if placement is None and "SLURM_PROCID" in env:
        placement = _slurm(env)
    if placement is None:
        return None
    p = placement
    checks = (
        (p.world_size >= 1, f"world size must be >= 1, got {p.world_size}"),
        (0 <= p.rank < p.world_size, f"rank {p.rank} is outside world size {p.world_size}"),
        (1 <= p.local_world_size <= p.world_size, f"local world size {p.local_world_size} is outside 1..{p.world_size}"),
        (0 <= p.local_rank < p.local_world_size, f"local rank {p.local_rank} is outside local world size {p.local_world_size}"),
    )
    for ok, message in checks:
        if not ok:
            raise LaunchError(f"inconsistent {p.source} environment: {message}")
    return placement


_WORLD_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def launcher_world_size(env: Optional[Mapping[str, str]] = None) -> Optional[tuple]:
    """``(variable, size)`` of the launcher that started this process, or None.

    Precedence as the launchers nest: torchrun's ``WORLD_SIZE`` (also under srun), then Open MPI, then
    MPICH/Intel MPI, then SLURM (``SLURM_NTASKS`` only inside a task, where ``SLURM_PROCID`` is set).
    Horovod's own variables do not count: they are what is checked.
    """
    env = os.environ if env is None else env
    for key in _WORLD_VARIABLES:
        if key == "SLURM_NTASKS" and "SLURM_PROCID" not in env:
            continue
        try:
            return key, int(env[key])
        except (KeyError, ValueError):
            continue
    return None


def check_world_size(actual: int, what: str, env: Optional[Mapping[str, str]] = None) -> None:
    """Raise LaunchError if the launcher started another number of ranks than ``what`` sees.

    Every rank makes the same check on its own (no communication: a one-rank world cannot
    talk to the others), so every rank raises; never a silent run of separate one-rank jobs.
    """
    found = launcher_world_size(env)
    if found is not None and found[1] != actual:
        key, size = found
        raise LaunchError(
            f"the launcher started {size} ranks ({key}={size}) but {what} sees a world of {actual}: the ranks "
            "would train as separate jobs. Bring the backend up from the launcher's environment "
            "(commhooks.horovod.init() does it for Horovod under mpirun, mpiexec, srun and torchrun; "
            "do not export HOROVOD_RANK / HOROVOD_SIZE or WORLD_SIZE by hand)")


def free_port(host: str = "") -> int:
    """A TCP port free right now on ``host`` (the one helper for rendezvous, the benchmark and the tests)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def fill_rendezvous_with_mpi(p: Placement) -> None:
    """Rank 0's host and a free port of its, broadcast with mpi4py."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchError(
            f"{p.source} launch without MASTER_ADDR/MASTER_PORT needs mpi4py to share them "
            "(pip install 'commhooks[mpi]'), or export MASTER_ADDR and MASTER_PORT"
        ) from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != p.world_size:
        raise LaunchError(
            f"mpi4py sees {comm.Get_size()} rank(s) but the {p.source} launcher says {p.world_size}: "
            "mpi4py is using another MPI library than the launcher (set MPI4PY_LIBMPI to the launcher's "
            "libmpi.so), or export MASTER_ADDR and MASTER_PORT"
        )
    mine = (socket.gethostname(), free_port()) if p.rank == 0 else None
    host, port = comm.bcast(mine, root=0)
    if p.master_addr is None:
        p.master_addr = "127.0.0.1" if p.local_world_size == p.world_size else host
    if p.master_port is None:
        p.master_port = port


def _horovod_initialized() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return hvd.is_initialized()


def _fill_rendezvous_with_horovod(p: Placement) -> None:
    """Under horovodrun (gloo), once hvd.init() ran: rank 0's host and free port, via hvd.broadcast_object."""
    import horovod.torch as hvd

    mine = (socket.gethostname(), free_port()) if p.rank == 0 else None
    # an explicit name: by default Horovod names the op after type(obj), which differs on the non-root ranks
    host, port = hvd.broadcast_object(mine, root_rank=0, name="commhooks.rendezvous")
    if p.master_addr is None:
        p.master_addr = "127.0.0.1" if p.local_world_size == p.world_size else host
    if p.master_port is None:
        p.master_port = port


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def local_cuda_index(local_rank: int, visible: Optional[int] = None, local_world_size: int = 1) -> int:
    """The CUDA device index this process uses: ``local_rank`` where the process sees every GPU of its node,
    and 0 where it sees one (``srun --gpus-per-task=1``, ``--gpu-bind``, wrappers that set
    ``CUDA_VISIBLE_DEVICES`` per task): there ``cuda:LOCAL_RANK`` does not exist.  ``visible`` defaults to
    ``torch.cuda.device_count()``.  Fewer visible GPUs than this local rank needs, but more than one, is
    ambiguous (two ranks would share a GPU, which NCCL refuses): a :class:`LaunchError` naming both.  So is one
    GPU for several ranks of a node with no ``CUDA_VISIBLE_DEVICES`` set (a one-GPU machine, not one GPU per
    task): NCCL would stop them later with "Duplicate GPU detected"."""
    visible = torch.cuda.device_count() if visible is None else visible
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible < 1:
        raise LaunchError(f"LOCAL_RANK {local_rank} asks for a GPU, and this process sees none "
                          f"(CUDA_VISIBLE_DEVICES={shown if shown is not None else '<unset>'})")
    if visible == 1:
        if local_world_size > 1 and shown is None:
            raise LaunchError(
                f"LOCAL_WORLD_SIZE {local_world_size} ranks on a node whose processes all see the same one GPU "
                "(CUDA_VISIBLE_DEVICES is unset): NCCL refuses two ranks on one GPU; start one rank per GPU, or "
                "give each task its own (srun --gpus-per-task=1)")
        return 0
    if local_rank < visible:
        return local_rank
    raise LaunchError(
        f"LOCAL_RANK {local_rank} and this process sees {visible} GPUs "
        f"(CUDA_VISIBLE_DEVICES={shown if shown is not None else '<unset>'}): give each task one GPU "
        "(srun --gpus-per-task=1) or all of the node's, one rank per GPU")


def init_distributed(backend: Optional[str] = None, timeout: float = 300.0) -> dict:
    """Initialise the default process group once; return the placement as a dict.

    ``timeout`` (seconds) bounds the rendezvous and every collective of the
    default group, so a missing rank fails the job instead of hanging it (on
    NCCL through its watchdog, which aborts a collective stuck past it).

    ``backend``: default ``"nccl"`` where CUDA and NCCL are present, else
    ``"gloo"``.  With NCCL (any backend string naming it or ``cuda``) the
    process binds its GPU (``cuda:LOCAL_RANK``, or ``cuda:0`` where each task
    sees one GPU: :func:`local_cuda_index`) with ``torch.cuda.set_device`` and
    passes it as ``device_id`` to ``init_process_group``, so the communicator
    is made for that GPU at once.
    """
    if dist.is_initialized():
        check_world_size(dist.get_world_size(), "torch.distributed")
        return {
            "rank": dist.get_rank(),
            "world_size": dist.get_world_size(),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
            "source": "initialised",
        }
    p = discover()
    if p is None:
        raise LaunchError(
            "no launcher environment found (RANK/WORLD_SIZE, OMPI_COMM_WORLD_*, PMI_*, SLURM_*): start the script "
            "with torchrun, mpirun, mpiexec or srun (e.g. torchrun --standalone --nproc_per_node 2 ...)"
        )
    if p.master_addr is None and p.local_world_size == p.world_size and p.source != "torchrun":
        p.master_addr = "127.0.0.1"  # one node: no need to ask anyone
    if p.master_addr is None or p.master_port is None:
        if p.source in ("openmpi", "mpich"):
            fill_rendezvous_with_mpi(p)
        elif p.source == "horovod" and _horovod_initialized():
            _fill_rendezvous_with_horovod(p)
        else:
            missing = [k for k, v in (("MASTER_ADDR", p.master_addr), ("MASTER_PORT", p.master_port)) if v is None]
            raise LaunchError(f"{p.source} environment without {' and '.join(missing)}: export it")
    os.environ.update(
        RANK=str(p.rank),
        WORLD_SIZE=str(p.world_size),
        LOCAL_RANK=str(p.local_rank),
        LOCAL_WORLD_SIZE=str(p.local_world_size),
        MASTER_ADDR=p.master_addr,
        MASTER_PORT=str(p.master_port),
    )
    backend = backend or default_backend()
    td = datetime.timedelta(seconds=timeout)
    kwargs = {}
    if "nccl" in backend or "cuda" in backend:
        index = local_cuda_index(p.local_rank, local_world_size=p.local_world_size)
        torch.cuda.set_device(index)
        if "nccl" in backend and "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", index)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun restarts reuse the agent's store: without a per-attempt prefix, a restarted rank can read
        # the dead attempt's gloo addresses and fail with "connection refused"
        store = dist.TCPStore(p.master_addr, int(p.master_port), p.world_size, is_master=False, timeout=td)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        kwargs["store"] = dist.PrefixStore(f"commhooks/attempt_{attempt}", store)
    dist.init_process_group(backend, rank=p.rank, world_size=p.world_size, timeout=td, **kwargs)
    check_world_size(dist.get_world_size(), "torch.distributed")
    return dataclasses.asdict(p)


def fresh_store():
    """A TCPStore made new at this start of the job, for what must not outlive it (torchft's Managers of a replica
    group find each other's address in one): ``(store, host, port)``, the store hosted by rank 0 (None on the other
    ranks: keep it alive as long as the job), its host (``MASTER_ADDR``) and port on every rank, the port sent over
    the default process group.  Without one, a store on 127.0.0.1 for this process alone.  Why not torchrun's own
    store: its restarts reuse it, and a restarted rank could read a dead start's keys (the old Manager's address).
    Collective where a process group is up."""
    if not dist.is_initialized():
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return store, "127.0.0.1", store.port
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False) if dist.get_rank() == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port)
    return store, host, port[0]


def shutdown() -> None:
    """Collect garbage, barrier, then destroy the group.

    Gloo can abort the process at exit ("terminate called without an active exception", rc 134): tensors of
    finished collectives kept alive by reference cycles (futures and their callbacks) are otherwise freed by
    gloo's worker threads while the interpreter is shutting down.  Collecting them now frees them here
    (measured: an AB run under mpirun aborted at exit in 4 of 6 runs without it, 0 of 8 with it)."""
    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
