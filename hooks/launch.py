"""Start ``torch.distributed`` from whatever launched the process.

Reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); an already
initialised process group is reused.  Picks gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(backend: str | None = None, timeout: float = 300.0) -> dict:
    """Initialise the default process group once; return ``{rank, world_size, local_rank, local_world_size}``."""
    if not dist.is_initialized():
        missing = [k for k in REQUIRED if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"cannot start torch.distributed: environment variable(s) {', '.join(missing)} missing; "
                "start the script with torchrun (e.g. torchrun --standalone --nproc_per_node 2 ...)"
            )
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend or default_backend(),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=timeout),
        )
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
    }


def shutdown() -> None:
    """Barrier, then destroy the group (gloo can abort at exit without the barrier)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
