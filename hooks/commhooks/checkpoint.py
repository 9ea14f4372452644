"""Checkpoints that resume a hooked run exactly, never lie about being complete, and load no foreign code.

Local methods make each rank's optimizer state (and, between syncs, its
weights) its own, so every rank writes its own file::

    <dir>/step-00000400/rank0.pt, rank1.pt, ..., manifest.json
    <dir>/latest                         -> "step-00000400", written last

Each rank file holds the model, the optimizer, the hook state (QSR: step,
since_sync, H; AB: step, phase clock, bases, ranks), the lr scheduler and the
RNG states (the CPU's, and the CUDA device's the model is on: dropout on a GPU
draws from it).  Files are read onto the CPU and every tensor then goes where
its owner lives (the model's and the optimizer's to their parameters, the
hook's to the synced tensors' device), so a checkpoint written on one device
loads on another.  Saving is collective:

1. the ranks agree on the step first (a rank at another step is a
   DivergenceError on every rank, before anything is written);
2. each rank writes its file to a temporary name, forces it to disk
   (``fsync``), renames it and forces the folder entry to disk;
3. the ranks exchange their files' sizes, read on the host: no rank goes on
   until every rank has written (a barrier alone does not hold the host under
   NCCL, where it only orders the GPU stream);
4. rank 0 waits until it sees every rank's file at the size that rank wrote
   (a shared filesystem may show another node's file late), then writes
   ``manifest.json`` (world size, step, whether the hook had just synced, the
   files' sizes), forces it to disk, and only then points ``latest`` at the
   folder and removes old ones.  If a file does not show up within
   ``commit_timeout_s``, nothing is committed and every rank raises the same
   :class:`CheckpointError` naming the file.

So ``latest`` and every folder with a manifest name a complete checkpoint, and
a save cut at any point leaves the previous one loadable.
Loading is collective too: every rank checks that its file exists and loads
(with ``weights_only=True``: a file that needs anything beyond tensors and
plain containers is refused, naming the file and the type); if any rank
fails, all of them fall back to the newest older complete checkpoint with a
warning naming what was skipped, or, when none is left or a step was asked
for, raise the same error on every rank naming the file.  A checkpoint of
another world size is refused with what to do, unless it was taken right
after a sync (``save_checkpoint(..., synced_only=True)`` guarantees that):
then every rank is the same model, and each new rank loads rank 0's file.

    commhooks.save_checkpoint("ckpt", model, optimizer, state, scheduler)
    ck = commhooks.load_checkpoint("ckpt", model, optimizer, state, scheduler)  # None: nothing to resume
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ._version import __version__
from .algorithms.consistency import DivergenceError, NonFiniteError

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: missing, incomplete, unreadable, or from another world size."""


# ------------------------------------------------------------------ collectives (state's Comm, else dist)


def _device(state, model) -> torch.device:
    """Where the agreement tensors go: the hook's device, else the model's (an NCCL group refuses CPU tensors)."""
    if state is not None and hasattr(state, "comm"):
        return state.comm.device
    module = getattr(model, "module", model)
    return next((p.device for p in module.parameters()), torch.device("cpu")) if module is not None else \
        torch.device("cpu")


def _rank_world(state) -> Tuple[int, int]:
    if state is not None and hasattr(state, "comm"):
        return state.comm.rank, state.comm.size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _allreduce_max(state, values: torch.Tensor) -> torch.Tensor:
    """Elementwise max over the ranks (unmetered), in place."""
    if _rank_world(state)[1] == 1:
        return values
    if state is not None and hasattr(state, "comm"):
        state.comm.allreduce([values], op="max", tag="checkpoint", metered=False)
    else:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


# ------------------------------------------------------------------ save


def _fsync_dir(folder: Path) -> None:
    """Force a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _durable_write(path: Path, write) -> int:
    """``write(file)`` to a temporary name, force it to disk, rename it to ``path``, force the folder entry:
    a reader sees the whole file or none.  Returns the file's size."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fd:
        write(fd)
        fd.flush()
        os.fsync(fd.fileno())
        size = fd.tell()
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return size


def _atomic_save(obj, path: Path) -> int:
    return _durable_write(path, lambda fd: torch.save(obj, fd))


def _sizes_on_every_rank(reduce, device, rank: int, world: int, size: Optional[int]) -> Tuple[List[int], List[int]]:
    """Every rank's file size (``None``: this rank could not write), read on the host: returns only once every
    rank has written its file (or failed to).  Returns (sizes, the ranks that failed)."""
    values = torch.zeros(2 * world, dtype=torch.float64, device=device)
    if size is None:
        values[world + rank] = 1.0
    else:
        values[rank] = float(size)
    values = [int(v) for v in reduce(values).tolist()]
    return values[:world], [r for r in range(world) if values[world + r]]


def _commit_wait(state, commit_timeout_s: float) -> float:
    """How long rank 0 may look for the files: ``commit_timeout_s``, but at most half the collective timeout the
    other ranks wait with meanwhile (gloo's, which raises), so they never give up on a commit rank 0 makes."""
    limit = getattr(getattr(state, "comm", None), "timeout_s", None)
    return commit_timeout_s if not limit else min(commit_timeout_s, limit / 2)


def _wait_until_visible(folder: Path, sizes: List[int], timeout_s: float) -> str:
    """Poll until ``folder`` shows every rank's file at the size it wrote; "" then, else what is missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = []
        for r, size in enumerate(sizes):
            path = folder / f"rank{r}.pt"
            try:
                seen = path.stat().st_size
            except OSError:
                seen = None
            if seen != size:
                missing.append(f"{path} ({'absent' if seen is None else f'{seen} bytes'}, rank {r} wrote {size})")
        if not missing or time.monotonic() > deadline:
            return "; ".join(missing)
        time.sleep(0.05)


def just_synced(state, step: int) -> bool:
    """Whether the hook synced right after ``step`` (every rank then holds the same model)."""
    return bool(state is not None and hasattr(state, "in_sync_at") and state.in_sync_at() == step)


def agree_to_save(state, model, step: int, who: str = "save_checkpoint") -> None:
    """Before anything is written: every rank at the same ``step`` (else DivergenceError on every rank) and no
    rank with a NaN/Inf gradient since its last sync (else NonFiniteError on every rank).  One allreduce."""
    rank, _ = _rank_world(state)
    nonfinite = float(bool(state is not None and hasattr(state, "alignment") and state.alignment.guard.seen() is not None))
    spread = _allreduce_max(state, torch.tensor([float(step), -float(step), nonfinite], dtype=torch.float64,
                                                device=_device(state, model))).tolist()
    high, low = int(spread[0]), -int(spread[1])
    if spread[2]:
        raise NonFiniteError(
            f"{who} at step {step}: a rank saw a NaN or Inf gradient since its last sync (the weights may "
            "hold it; nothing was written); the rank that saw it names the step and the parameters at its next sync")
    if high != low:
        raise DivergenceError(
            f"{who}: the ranks are at different steps (from {low} to {high}; this rank {rank} at {step}): "
            "call it at the same point of the loop on every rank; nothing was written")


def save_checkpoint(directory, model, optimizer, state=None, scheduler=None, step: Optional[int] = None,
                    extra=None, keep: int = 2, synced_only: bool = False,
                    commit_timeout_s: float = 60.0) -> Optional[Path]:
    """Write this rank's file of checkpoint ``step`` (default: the hook's step); collective.

    ``model`` may be wrapped (DDP's ``.module`` is saved).  ``keep`` complete
    checkpoints are kept; older ones are removed by rank 0.  ``extra`` must be
    tensors and plain containers (it is loaded with ``weights_only=True``).
    ``synced_only=True`` writes only if the hook synced at this very step
    (returns None otherwise): such a checkpoint also resumes on another number
    of ranks.  ``commit_timeout_s``: how long rank 0 waits to see every rank's
    file before it gives up on this checkpoint (raising on every rank); raise
    it for a shared filesystem that shows other nodes' files late (it is capped at half the
    hook's collective timeout, which the other ranks wait with meanwhile).
    :class:`commhooks.Checkpointer` saves on a schedule, off the training thread.
    """
    if step is None:
        if state is None:
            raise ValueError("save_checkpoint needs step= when no hook state is given")
        step = state.step
    rank, world = _rank_world(state)
    agree_to_save(state, model, step)
    synced = just_synced(state, step)
    if synced_only and not synced:
        return None
    contents = checkpoint_contents(model, optimizer, state, scheduler, step, synced, extra)
    return write_and_commit(directory, step, contents, rank, world, lambda v: _allreduce_max(state, v),
                            _device(state, model), keep, _commit_wait(state, commit_timeout_s), commit_timeout_s)


def checkpoint_contents(model, optimizer, state, scheduler, step: int, synced: bool, extra=None) -> dict:
    """What one rank's file holds (live tensors: copy them before training goes on, as the Checkpointer does)."""
    rank, world = _rank_world(state)
    return {
        "version": __version__,
        "step": step,
        "rank": rank,
        "world_size": world,
        "synced": synced,
        "model": getattr(model, "module", model).state_dict(),
        "optimizer": [o.state_dict() for o in optimizer] if isinstance(optimizer, (list, tuple)) else
        optimizer.state_dict(),
        "hook": state.state_dict() if hasattr(state, "state_dict") else None,  # {"type": "none"}'s has none
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        **rng_states(model),
        "extra": extra,
    }


def write_and_commit(directory, step: int, contents: dict, rank: int, world: int, reduce, device, keep: int,
                     commit_wait_s: float, commit_timeout_s: float, on_event=None) -> Path:
    """Write this rank's file durably, then commit the checkpoint: steps 2-4 of the module's docstring.

    ``reduce(values)`` is an elementwise max over the ranks, in place, that returns on the host only once every
    rank has contributed (the hook's Comm, or the Checkpointer's own gloo group on its writer thread).
    ``on_event(name, step)``, if given, is told ``"writing"`` before this rank's file is written and
    ``"written"`` once it is durable.
    """
    root = Path(directory)
    folder = root / f"step-{step:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    wrote = ""
    try:  # a rank that cannot write says so in the size exchange: every rank then raises, none waits
        if on_event is not None:
            on_event("writing", step)
        size = _atomic_save(contents, folder / f"rank{rank}.pt")
        if on_event is not None:
            on_event("written", step)
    except Exception as exc:  # noqa: BLE001 - any failure to write: a full disk, an unpicklable `extra`
        size, wrote = None, f"{type(exc).__name__}: {exc}"
    sizes, unwritten = _sizes_on_every_rank(reduce, device, rank, world, size)  # on the host: every rank has written
    if unwritten:
        raise CheckpointError(
            f"checkpoint {folder} was not written by rank(s) {unwritten} (the previous one stays the latest)"
            + (f"; this rank: {wrote}" if wrote else ""))
    missing = ""
    if rank == 0:
        try:
            missing = _wait_until_visible(folder, sizes, commit_wait_s)
            if not missing:
                manifest = {"step": step, "world_size": world, "synced": contents["synced"], "version": __version__,
                            "sizes": sizes}
                _durable_write(folder / MANIFEST, lambda fd: fd.write(json.dumps(manifest).encode()))
                _durable_write(root / "latest", lambda fd: fd.write(folder.name.encode()))
                complete = [p for p in _complete_folders(root)]
                for old in complete[keep:] if keep > 0 else []:
                    shutil.rmtree(old, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 - anything: the flag below is always exchanged, no rank waits
            missing = f"rank 0 could not write the manifest or `latest` ({type(exc).__name__}: {exc})"
    failed = torch.tensor([1.0 if missing else 0.0], dtype=torch.float64, device=device)
    if reduce(failed).tolist()[0]:  # on the host: rank 0 has committed, or given up
        raise CheckpointError(
            f"checkpoint {folder} was not committed (the previous one stays the latest): rank 0 did not see every "
            f"rank's file within commit_timeout_s={commit_timeout_s:g} s"
            + (f": {missing}" if missing else " (this rank's view is in rank 0's error)")
            + "; save to a folder every rank shares (a shared filesystem), or raise commit_timeout_s")
    return folder


# ------------------------------------------------------------------ load


def _manifest(folder: Path) -> Optional[dict]:
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _complete_folders(root: Path) -> List[Path]:
    """Folders with a manifest, newest step first (each manifest read once)."""
    steps = {p: m["step"] for p in root.glob("step-*") if p.is_dir() and (m := _manifest(p)) is not None}
    return sorted(steps, key=steps.get, reverse=True)


def latest_checkpoint(directory) -> Optional[Path]:
    """The newest complete checkpoint folder: the one ``latest`` names if it is complete, else the newest
    folder with a manifest; None if there is none."""
    root = Path(directory)
    pointer = root / "latest"
    if pointer.is_file():
        folder = root / pointer.read_text().strip()
        if folder.is_dir() and _manifest(folder) is not None:
            return folder
    complete = _complete_folders(root) if root.is_dir() else []
    return complete[0] if complete else None


def _read(path: Path) -> Tuple[Optional[dict], str]:
    """(contents, "") or (None, why) for one rank file, loaded without running foreign code."""
    if not path.is_file():
        return None, f"{path} is missing"
    try:
        return torch.load(path, map_location="cpu", weights_only=True), ""
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        return None, (f"{path} needs more than tensors and plain containers to load, refused (weights_only=True): "
                      f"{lines[0] if lines else type(exc).__name__}")
    except Exception as exc:  # a truncated or corrupt file: torch's zip reader errors
        return None, f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"


def _file_for(folder: Path, rank: int, world: int) -> Tuple[Optional[Path], str]:
    manifest = _manifest(folder) or {}
    saved_world = manifest.get("world_size", world)
    if saved_world == world:
        return folder / f"rank{rank}.pt", ""
    if manifest.get("synced"):
        return folder / "rank0.pt", ""  # right after a sync every rank held the same model
    return None, (
        f"{folder} was written by {saved_world} ranks and this run has {world}: between syncs each rank's model "
        f"is its own, so it cannot be split or merged; resume with {saved_world} ranks, or from a checkpoint "
        "taken right after a sync (save_checkpoint(..., synced_only=True), or any checkpoint at a sync step)")


def load_checkpoint(directory, model, optimizer, state=None, scheduler=None, step: Optional[int] = None) -> Optional[dict]:
    """Restore this rank's part of the newest complete checkpoint (or of ``step``); collective.

    Returns the file's contents, or None when the directory holds no
    checkpoint.  Every rank returns the same step or raises the same
    :class:`CheckpointError`.
    """
    rank, world = _rank_world(state)
    root = Path(directory)
    if step is not None:
        candidates = [root / f"step-{step:08d}"]
    else:
        candidates = _complete_folders(root) if root.is_dir() else []
        pointer = root / "latest"
        named = root / pointer.read_text().strip() if pointer.is_file() else None
        if named is not None and named not in candidates:
            warnings.warn(f"{root / 'latest'} names {named.name}, which is not a complete checkpoint; "
                          "looking at the complete ones beside it", stacklevel=2)
    # every rank walks the same list, so every rank makes the same decisions
    device = _device(state, model)
    seen = _allreduce_max(state, torch.tensor([len(candidates), -len(candidates)], dtype=torch.float64,
                                              device=device)).tolist()
    if int(seen[0]) != -int(seen[1]):
        raise CheckpointError(f"the ranks see different checkpoints in {root} (is it on a shared filesystem?)")
    if not candidates:
        return None
    skipped: List[str] = []
    for folder in candidates:
        path, why = _file_for(folder, rank, world)
        ck = None
        if path is not None:
            ck, why = _read(path)
            if ck is not None and ck.get("step") != (_manifest(folder) or {}).get("step", ck.get("step")):
                ck, why = None, f"{path} holds step {ck.get('step')}, not the folder's"
        failed = [0.0] * world
        failed[rank] = 0.0 if ck is not None else 1.0
        failed = _allreduce_max(state, torch.tensor(failed, dtype=torch.float64, device=device)).tolist()
        if not any(failed):
            try:
                _restore(ck, model, optimizer, state, scheduler)
            except (ValueError, KeyError, RuntimeError) as exc:  # the same file kind on every rank: the same error
                raise CheckpointError(f"cannot resume from {path}: {exc}") from exc
            if skipped:
                warnings.warn(f"resumed from {folder.name}; skipped newer checkpoints: {'; '.join(skipped)}",
                              stacklevel=2)
            return ck
        bad = [r for r in range(world) if failed[r]]
        if path is None:  # another world size: the same verdict on every rank
            reason = why
        else:
            files = ", ".join(str(_file_for(folder, r, world)[0]) for r in bad)
            reason = f"missing or unreadable on rank(s) {bad}: {files}" + (f" [this rank: {why}]" if ck is None else "")
        skipped.append(f"{folder.name} ({reason})")
        if step is not None or path is None:
            raise CheckpointError(f"cannot resume from {folder}: {reason}")
    raise CheckpointError(f"no usable checkpoint in {root}: {'; '.join(skipped)}")


def _restore(ck: dict, model, optimizer, state, scheduler) -> None:
    getattr(model, "module", model).load_state_dict(ck["model"])
    if isinstance(optimizer, (list, tuple)):
        for opt, saved in zip(optimizer, ck["optimizer"]):
            opt.load_state_dict(saved)
    else:
        optimizer.load_state_dict(ck["optimizer"])
    if state is not None and ck["hook"] is not None:
        state.load_state_dict(ck["hook"])
    if scheduler is not None and ck["scheduler"] is not None:
        scheduler.load_state_dict(ck["scheduler"])
    restore_rng_states(ck, model)


def _model_device(model) -> torch.device:
    module = getattr(model, "module", model)
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def rng_states(model) -> dict:
    """The RNG states a checkpoint keeps: the CPU's (``rng``), and the CUDA device's the model is on (``cuda_rng``,
    None for a model elsewhere: dropout on a GPU draws from it)."""
    device = _model_device(model)
    return {"rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def restore_rng_states(saved: dict, model) -> None:
    """Set the RNG states :func:`rng_states` kept (the CUDA one on the device the model is on)."""
    torch.set_rng_state(saved["rng"])
    device = _model_device(model)
    if saved.get("cuda_rng") is not None and device.type == "cuda":
        torch.cuda.set_rng_state(saved["cuda_rng"], device)
