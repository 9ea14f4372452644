"""Checkpoints that resume a hooked run exactly, and survive a rank dying mid-save.

Local methods make each rank's optimizer state (and, between syncs, its
weights) its own, so every rank writes its own file::

    <dir>/step-00000400/rank0.pt, rank1.pt, ...
    <dir>/latest                         -> "step-00000400", written last

Each file holds the model, the optimizer, the hook state (QSR: step,
since_sync, H; AB: step, phase clock, bases, ranks), the lr scheduler and the
RNG state.  Files are written to a temporary name and renamed; after a
barrier, rank 0 points ``latest`` at the new folder, so ``latest`` only ever
names a checkpoint that every rank finished.  A run killed at any moment
resumes from the last complete one: nothing before it is lost.

    commhooks.save_checkpoint("ckpt", model, optimizer, state, scheduler)
    step = commhooks.load_checkpoint("ckpt", model, optimizer, state, scheduler)  # None: nothing to resume
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ._version import __version__


def _rank(state) -> int:
    if state is not None and hasattr(state, "comm"):
        return state.comm.rank
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(state) -> None:
    if state is not None and hasattr(state, "comm"):
        state.comm.barrier()
    elif dist.is_initialized():
        dist.barrier()


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(directory, model, optimizer, state=None, scheduler=None, step: Optional[int] = None,
                    extra=None, keep: int = 2) -> Path:
    """Write this rank's file of checkpoint ``step`` (default: the hook's step); collective (a barrier).

    ``model`` may be wrapped (DDP's ``.module`` is saved).  ``keep`` complete
    checkpoints are kept; older ones are removed by rank 0.
    """
    if step is None:
        if state is None:
            raise ValueError("save_checkpoint needs step= when no hook state is given")
        step = state.step
    rank = _rank(state)
    root = Path(directory)
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    module = getattr(model, "module", model)
    _atomic_save({
        "version": __version__,
        "step": step,
        "model": module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "hook": None if state is None else state.state_dict(),
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "rng": torch.get_rng_state(),
        "extra": extra,
    }, folder / f"rank{rank}.pt")
    _barrier(state)  # every rank's file is on disk before `latest` moves
    if rank == 0:
        tmp = root / f"latest.tmp{os.getpid()}"
        tmp.write_text(folder.name)
        os.replace(tmp, root / "latest")
        complete = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in complete[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(state)
    return folder


def latest_checkpoint(directory) -> Optional[Path]:
    """The folder ``latest`` names, or None."""
    pointer = Path(directory) / "latest"
    if not pointer.is_file():
        return None
    folder = Path(directory) / pointer.read_text().strip()
    return folder if folder.is_dir() else None


def load_checkpoint(directory, model, optimizer, state=None, scheduler=None, step: Optional[int] = None) -> Optional[dict]:
    """Restore this rank's part of the latest complete checkpoint (or of ``step``); its contents, or None."""
    folder = latest_checkpoint(directory) if step is None else Path(directory) / f"step-{step:08d}"
    if folder is None or not folder.is_dir():
        return None
    path = folder / f"rank{_rank(state)}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no file for this rank ({path.name}): was the world size changed?")
    ck = torch.load(path, map_location="cpu", weights_only=False)
    getattr(model, "module", model).load_state_dict(ck["model"])
    optimizer.load_state_dict(ck["optimizer"])
    if state is not None and ck["hook"] is not None:
        state.load_state_dict(ck["hook"])
    if scheduler is not None and ck["scheduler"] is not None:
        scheduler.load_state_dict(ck["scheduler"])
    torch.set_rng_state(ck["rng"])
    return ck
