"""DeepSpeed checkpoints per replica group, with every rank's hook state beside DeepSpeed's files.

Between syncs the replica groups' weights and optimizer states differ, but DeepSpeed names its checkpoint files
by data-parallel rank, so the groups would overwrite each other's files in one folder.  The engine's own
``save_checkpoint`` / ``load_checkpoint`` (what the Hugging Face Trainer, Accelerate and users call) are
therefore routed (:func:`route_checkpoints`, done by :func:`~commhooks.deepspeed.attach`): the first replica
group writes where DeepSpeed would (``path/<tag>/...``, where tools look for it), the others in
``path/replica<g>``, and each rank adds its hook state (``comm_hook_rank<r>.pt``).  Both stay collective: a
rank that refuses (a NaN) or finds nothing refuses on every rank, before any write or after the load.  DeepSpeed
commits its own files (its ``latest``); the hook files are written durably (:func:`commhooks.commit.atomic_save`,
the same file a ``torch.save`` writes); the load's agreement is one two-element sum over the world.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..commit import CheckpointError, atomic_save


def _replica_dir(engine, path) -> str:
    """Where this rank's replica group writes under ``path``: ``path`` itself for the first group (so the folder
    looks as DeepSpeed's own, ``path/<tag>/...``, for tools that look there: the Hugging Face Trainer checks for
    ``global_step*``), ``path/replica<g>`` for the others.  DeepSpeed names its files by data-parallel rank, so
    groups whose weights and optimizer states differ between syncs must not write into the same folder."""
    state = getattr(engine, "comm_hook_state", None)
    import torch.distributed as dist

    if state is None or not state.engine.replica_data_parallel or engine.dp_world_size == dist.get_world_size():
        return str(path)
    group = dist.get_rank() // engine.dp_world_size
    return str(path) if group == 0 else os.path.join(str(path), f"replica{group}")


def route_checkpoints(engine) -> None:
    """Make the engine's own ``save_checkpoint`` / ``load_checkpoint`` (what the Hugging Face Trainer, Accelerate and
    users call) write and read per replica group and carry the hook's per-rank state; both stay collective."""
    if getattr(engine, "_commhooks_checkpoints", False):
        return
    original_save, original_load = engine.save_checkpoint, engine.load_checkpoint

    def save(save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        return _save(engine, original_save, save_dir, tag, client_state, save_latest, **kwargs)

    def load(load_dir, tag=None, **kwargs):
        return _load(engine, original_load, load_dir, tag, **kwargs)

    engine.save_checkpoint, engine.load_checkpoint = save, load  # instance attributes: this engine only
    engine._commhooks_checkpoints = True


def _save(engine, original, save_dir, tag, client_state, save_latest, **kwargs):
    import torch.distributed as dist

    where = _replica_dir(engine, save_dir)
    tag = tag if tag is not None else f"global_step{engine.global_steps}"
    state = getattr(engine, "comm_hook_state", None)
    if state is not None and hasattr(state, "alignment"):  # all ranks refuse together, before any write
        state.alignment.refuse_everywhere(f"checkpoint after optimizer step {state.step} (nothing was written)")
    out = original(where, tag=tag, client_state=client_state or {}, save_latest=save_latest, **kwargs)
    if save_latest and dist.get_rank() != 0 and where != str(save_dir) and (
            dist.get_rank() % engine.dp_world_size == 0):  # DeepSpeed writes 'latest' on global rank 0 only
        with open(os.path.join(where, "latest"), "w") as fd:
            fd.write(str(tag))
    state = getattr(engine, "comm_hook_state", None)
    if state is not None:
        os.makedirs(os.path.join(where, str(tag)), exist_ok=True)
        atomic_save(state.state_dict(), Path(where, str(tag), f"comm_hook_rank{dist.get_rank()}.pt"))
    dist.barrier()
    return out


def _load(engine, original, load_dir, tag=None, **kwargs):
    import torch.distributed as dist

    where = _replica_dir(engine, load_dir)
    path, client_state = original(where, tag=tag, **kwargs)
    device = next(engine.module.parameters()).device  # the process group's device (NCCL: the GPU)
    loaded = torch.tensor([0.0 if path is None else 1.0, 1.0 if path is None else 0.0], device=device)
    dist.all_reduce(loaded)  # how many ranks loaded, how many found nothing: all or none, or an error everywhere
    if loaded[0] and loaded[1]:
        raise CheckpointError(
            f"{int(loaded[1])} rank(s) found no checkpoint under {load_dir} (this rank looked in {where}, tag "
            f"{tag!r}) while {int(loaded[0])} loaded one: every replica group needs its own folder, as "
            "commhooks.deepspeed.save_checkpoint writes them")
    state = getattr(engine, "comm_hook_state", None)
    if state is not None and path is not None:
        hook_file = os.path.join(os.path.dirname(path) if os.path.isfile(path) else path,
                                 f"comm_hook_rank{dist.get_rank()}.pt")
        if not os.path.exists(hook_file):
            raise CheckpointError(f"{hook_file} is missing: the checkpoint was not written by an engine with the "
                                  "comm hook attached (the hook's schedule and each replica's state cannot resume)")
        try:
            state.load_state_dict(torch.load(hook_file, map_location="cpu", weights_only=True))
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"cannot resume the comm hook from {hook_file}: {exc}") from exc
    return path, client_state


def save_checkpoint(engine, save_dir, tag=None, client_state=None, **kwargs):
    """``engine.save_checkpoint`` with the hook's state, per replica group; collective (every rank calls it).

    Since the hook is attached, the engine's own ``save_checkpoint`` does the same (it is routed): this name
    stays for scripts that use it.  Resumes exactly with :func:`load_checkpoint` (or the engine's own) on the
    same layout: the first replica group's files in ``save_dir``, the others' in ``save_dir/replica<g>``, each
    rank's hook state (``comm_hook_rank<r>.pt``) beside DeepSpeed's files.  Returns what DeepSpeed returns."""
    route_checkpoints(engine)
    return engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, **kwargs)


def load_checkpoint(engine, load_dir, tag=None, **kwargs):
    """``engine.load_checkpoint`` with the hook's state saved by :func:`save_checkpoint`; returns DeepSpeed's
    ``(path, client_state)``.  A missing hook state raises :class:`~commhooks.checkpoint.CheckpointError`."""
    route_checkpoints(engine)
    return engine.load_checkpoint(load_dir, tag=tag, **kwargs)
