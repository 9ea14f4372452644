"""Checkpoints of a ``fully_shard`` run in ``torch.distributed.checkpoint`` (DCP) format, with commhooks' state.

FSDP2 users save with DCP: each rank writes its shards, and a checkpoint loads on another sharding.  The
model and the optimizer go through torch's own ``get_model_state_dict`` / ``get_optimizer_state_dict``, as
torchtitan saves them; beside them, under ``commhooks``, each rank's algorithm state (anchors, outer momentum,
error-feedback residuals, syncs in flight, the rule's position, the meter) and RNG states, under a key of
its own (``commhooks.rank3``): between syncs every replica group's model is its own, and DCP would keep one
copy of a value that every rank saves under the same key.  For the same reason the model and optimizer of
each replica group but the first go under a key of their own (``commhooks_replica1.model``); the first
group's are where a plain FSDP2 checkpoint has them, so a synced checkpoint loads into a run without
commhooks as it is.  The layout (world, shard group, step, whether the hook had just synced) is saved once.

    commhooks.fsdp.save_checkpoint("ckpt/step-400", model, optimizer, state, scheduler)
    commhooks.fsdp.load_checkpoint("ckpt/step-400", model, optimizer, state, scheduler)

Exact: a resumed run takes the same steps, bit for bit, as one never stopped, mid-round and with a sync in
flight (its result is saved, as :mod:`commhooks.checkpoint` saves it).  A checkpoint saved right after a sync
(``synced_only=True`` saves only then) loads at another replica count with the same shard group size: each
rank loads the state of its counterpart in the first replica group (every group held the same then), and DCP
reshards nothing (the shards are the same).  Refused on every rank alike, naming the checkpoint: another
world or shard group size unless synced, a checkpoint without commhooks' state (from a run without it: load
the model yourself, then register), a NaN/Inf gradient or ranks at different steps at save.  DCP writes
its ``.metadata`` last, after every rank's files: a save cut short leaves a folder that does not load.  The
ranks agree before the save as every commhooks checkpoint does (:class:`commhooks.commit.CommitGroup`); DCP
commits the folder.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from .._version import __version__
from ..checkpoint import restore_rng_states, rng_states
from ..commit import CheckpointError, CommitGroup, just_synced
from .model import shard_group

KEY = "commhooks"


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as sd

    return dcp, sd


def _bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _replica(index: int, entries: dict) -> dict:
    """Where replica group ``index`` keeps its model and optimizer: the first group under the keys FSDP2 users
    and their tools read (``model``, ``optimizer``), the others under ``commhooks_replica<index>``.  DCP keys a
    DTensor's shards by their global offsets: two groups' shards under one key would be taken for one tensor,
    and one group's weights would overwrite the other's."""
    return dict(entries) if index == 0 else {f"{KEY}_replica{index}": entries}


def save_checkpoint(path, model, optimizer, state, scheduler=None, synced_only: bool = False) -> Optional[Path]:
    """Save model, optimizer, ``state`` (and ``scheduler``) to the DCP folder ``path``; collective.

    ``synced_only=True``: only if the hook synced at this very step (returns None otherwise); such a checkpoint
    also loads at another replica count."""
    dcp, sd = _dcp()
    step = state.step
    CommitGroup(state, model).agree_to_save(step, "commhooks.fsdp.save_checkpoint")  # DCP commits the folder
    synced = just_synced(state, step)
    if synced_only and not synced:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {"version": __version__, "step": step, "rank": rank, "hook": state.state_dict(), **rng_states(model)}
    group = len(shard_group(model))
    layout = {"world_size": world, "group_size": group, "step": step, "synced": synced}
    content = _replica(rank // group, {"model": sd.get_model_state_dict(model),
                                       "optimizer": sd.get_optimizer_state_dict(model, optimizer)})
    content[KEY] = {f"rank{rank}": _bytes(mine), "layout": layout}
    if scheduler is not None:
        content["scheduler"] = _bytes(scheduler.state_dict())
    dcp.save(content, checkpoint_id=str(path))
    return Path(path)


def _layout(dcp, path: str) -> Optional[dict]:
    """The saved layout, or None when the checkpoint holds no commhooks state."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if f"{KEY}.layout.world_size" not in keys:
        return None
    layout = {"world_size": 0, "group_size": 0, "step": 0, "synced": False}
    dcp.load({KEY: {"layout": layout}}, checkpoint_id=path)
    return layout


def _source(layout: dict, path: str, rank: int, world: int, group: int) -> int:
    """Whose commhooks state this rank loads (the same verdict on every rank: the layout is the same)."""
    if layout["world_size"] == world and layout["group_size"] == group:
        return rank
    if layout["synced"] and layout["group_size"] == group:
        return rank % group  # the counterpart in the first replica group: every group held the same model
    raise CheckpointError(
        f"cannot resume from {path}: it was saved by {layout['world_size']} ranks in shard groups of "
        f"{layout['group_size']} at step {layout['step']}, this run has {world} in groups of {group}: between syncs "
        "each replica group's model is its own and its commhooks state is per shard; resume with the same "
        "layout, or from a checkpoint saved right after a sync (save_checkpoint(..., synced_only=True)) with "
        "the same shard group size")


def load_checkpoint(path, model, optimizer, state, scheduler=None) -> Optional[dict]:
    """Restore ``path`` into model, optimizer, ``state`` (and ``scheduler``); collective.  Returns this rank's
    commhooks record (step, rank, the hook's state), or None when ``path`` does not exist."""
    dcp, sd = _dcp()
    path = str(path)
    if not Path(path).exists():
        return None
    rank, world, group = dist.get_rank(), dist.get_world_size(), len(shard_group(model))
    layout = _layout(dcp, path)
    if layout is None:
        raise CheckpointError(
            f"cannot resume from {path}: it holds no commhooks state (saved without commhooks.fsdp."
            "save_checkpoint?); between syncs every replica group's model and the sync's state are its own, so "
            "a resume without them would not be the run that was saved.  To start a new run from its weights, "
            "load the model yourself before commhooks.fsdp.register")
    source = _source(layout, path, rank, world, group)
    with state.alignment.outside_training():  # torch takes a zero-lr step to create a fresh optimizer's state
        ours = {"model": sd.get_model_state_dict(model), "optimizer": sd.get_optimizer_state_dict(model, optimizer)}
        content = {**_replica(source // group, ours), KEY: {f"rank{source}": io.BytesIO()}}
        if scheduler is not None:
            content["scheduler"] = io.BytesIO()
        dcp.load(content, checkpoint_id=path)
        sd.set_model_state_dict(model, ours["model"])
        sd.set_optimizer_state_dict(model, optimizer, ours["optimizer"])
    mine = _record(content[KEY][f"rank{source}"])
    try:
        state.load_state_dict(mine["hook"])
    except (ValueError, KeyError, RuntimeError) as exc:  # the same layout on every rank: the same error
        raise CheckpointError(f"cannot resume from {path}: {exc}") from exc
    if scheduler is not None:
        scheduler.load_state_dict(_record(content["scheduler"]))
    if source == rank:  # another layout: the ranks draw on from their own generators
        restore_rng_states(mine, model)
    return mine


def _record(value) -> dict:
    """A record saved as bytes: DCP hands back the object it pickled (our buffer); read it as tensors and plain
    containers only."""
    if isinstance(value, io.BytesIO):
        value.seek(0)
        return torch.load(value, map_location="cpu", weights_only=True)
    return value
