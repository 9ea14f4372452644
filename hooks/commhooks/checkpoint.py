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
loads on another.  Saving is collective (steps 1-4 are :mod:`commhooks.commit`'s, the one agreement and commit
the Checkpointer, FSDP's and DeepSpeed's checkpoints share; this module decides what a rank's file holds and how
it loads):

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

import pickle
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ._version import __version__
from .commit import (MANIFEST, LATEST, CheckpointError, CommitGroup, complete_folders, file_digest,  # noqa: F401
                     just_synced, latest_checkpoint, read_manifest, step_folder)
# (CheckpointError, latest_checkpoint, just_synced, MANIFEST: importable from here as before)


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
    group = CommitGroup(state, model)
    group.agree_to_save(step)
    synced = just_synced(state, step)
    if synced_only and not synced:
        return None
    contents = checkpoint_contents(model, optimizer, state, scheduler, step, synced, extra)
    return group.commit(directory, step, contents, keep, commit_timeout_s)


def checkpoint_contents(model, optimizer, state, scheduler, step: int, synced: bool, extra=None) -> dict:
    """What one rank's file holds (live tensors: copy them before training goes on, as the Checkpointer does)."""
    group = CommitGroup(state, model)
    rank, world = group.rank, group.world
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


# ------------------------------------------------------------------ load


def _read(path: Path, digest: Optional[str] = None) -> Tuple[Optional[dict], str]:
    """(contents, "") or (None, why) for one rank file, loaded without running foreign code; ``digest``: its SHA-256
    as the manifest recorded it (checkpoints committed before 2026-12-06 have none)."""
    if not path.is_file():
        return None, f"{path} is missing"
    if digest is not None and file_digest(path) != digest:
        return None, (f"{path} does not match the SHA-256 its manifest recorded: it changed after it was written "
                      "(bit rot, an interrupted copy)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True), ""
    except pickle.UnpicklingError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        return None, (f"{path} needs more than tensors and plain containers to load, refused (weights_only=True): "
                      f"{lines[0] if lines else type(exc).__name__}")
    except Exception as exc:  # a truncated or corrupt file: torch's zip reader errors
        return None, f"{path} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"


def _file_for(folder: Path, rank: int, world: int) -> Tuple[Optional[Path], str]:
    manifest = read_manifest(folder) or {}
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
    group = CommitGroup(state, model)
    rank, world = group.rank, group.world
    root = Path(directory)
    if step is not None:
        candidates = [step_folder(root, step)]
    else:
        candidates = complete_folders(root) if root.is_dir() else []
        pointer = root / LATEST
        named = root / pointer.read_text().strip() if pointer.is_file() else None
        if named is not None and named not in candidates:
            warnings.warn(f"{root / 'latest'} names {named.name}, which is not a complete checkpoint; "
                          "looking at the complete ones beside it", stacklevel=2)
    # every rank walks the same list, so every rank makes the same decisions
    seen = group.allreduce_max(torch.tensor([len(candidates), -len(candidates)], dtype=torch.float64,
                                            device=group.device)).tolist()
    if int(seen[0]) != -int(seen[1]):
        raise CheckpointError(f"the ranks see different checkpoints in {root} (is it on a shared filesystem?)")
    if not candidates:
        return None
    skipped: List[str] = []
    for folder in candidates:
        path, why = _file_for(folder, rank, world)
        ck = None
        if path is not None:
            digests = (read_manifest(folder) or {}).get("sha256")
            ck, why = _read(path, digests[int(path.stem[4:])] if digests else None)
            if ck is not None and ck.get("step") != (read_manifest(folder) or {}).get("step", ck.get("step")):
                ck, why = None, f"{path} holds step {ck.get('step')}, not the folder's"
        bad = group.ranks_where(ck is None)
        if not bad:
            try:
                _restore(ck, model, optimizer, state, scheduler)
            except (ValueError, KeyError, RuntimeError) as exc:  # the same file kind on every rank: the same error
                raise CheckpointError(f"cannot resume from {path}: {exc}") from exc
            if skipped:
                warnings.warn(f"resumed from {folder.name}; skipped newer checkpoints: {'; '.join(skipped)}",
                              stacklevel=2)
            return ck
        if path is None:  # another world size: the same verdict on every rank
            reason = why
        else:
            files = ", ".join(str(_file_for(folder, r, world)[0]) for r in bad)
            reason = f"missing, unreadable or changed on rank(s) {bad}: {files}" + (f" [this rank: {why}]" if ck is None else "")
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
