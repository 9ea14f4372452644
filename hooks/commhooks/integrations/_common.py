"""What the framework integrations share: finding the DDP model a framework keeps, and per-rank checkpoints
beside the framework's own."""

from __future__ import annotations

import gc
import os
from typing import Optional

import torch

from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint

SUBDIR = "commhooks"  # inside a framework's checkpoint folder: step-<N>/rank<r>.pt, manifest.json, latest


def fill_schedule(conf, max_steps: int, warmup: int) -> dict:
    """The config's schedule keys (``schedule_keys``: total_steps, the rule's warmup_steps) left unset, from the
    Trainer's run; returns what was filled."""
    values = {"total": max_steps, "warmup": warmup}
    filled = {}
    for key, what in getattr(type(conf), "schedule_keys", {}).items():
        unset = key not in conf.model_fields_set or getattr(conf, key) is None
        if unset and values.get(what) is not None:
            setattr(conf, key, int(values[what]))
            filled[key] = int(values[what])
    return filled


def find_ddp(module: torch.nn.Module) -> Optional[torch.nn.parallel.DistributedDataParallel]:
    """The ``DistributedDataParallel`` wrapping ``module`` (frameworks hand callbacks the unwrapped module and
    keep the DDP one to themselves); ``module`` itself if it is one; None if there is none."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    if isinstance(module, ddp_class):
        return module
    for obj in gc.get_objects():
        try:
            if isinstance(obj, ddp_class) and obj.module is module:
                return obj
        except ReferenceError:  # a weakref proxy whose object is gone
            continue
    return None


def save_ranks(folder: str, model, optimizer, state, step: int) -> None:
    """Every rank's weights, optimizer state and hook state for ``step``, in ``folder/commhooks`` (collective)."""
    save_checkpoint(os.path.join(folder, SUBDIR), model, optimizer, state, step=step, keep=0)


def load_ranks(folder: str, model, optimizer, state, step: Optional[int], framework: str) -> dict:
    """Restore this rank's own weights, optimizer and hook state of ``step`` (None: the one there) from
    ``folder/commhooks`` over what the framework loaded (rank 0's); collective.  A checkpoint without them is refused on every rank: resuming the
    ranks from rank 0's model and optimizer with the hook at another step ends with different models."""
    root = os.path.join(folder, SUBDIR)
    try:
        ck = load_checkpoint(root, model, optimizer, state, step=step)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{framework}: resuming{'' if step is None else f' at step {step}'}, but {root} lacks the per-rank state commhooks keeps (between syncs "
            f"every rank's weights and optimizer are its own; {framework}'s checkpoint holds rank 0's): {exc}. Resume "
            "from a checkpoint written with the commhooks integration, or start a new run") from None
    if ck is None:
        raise CheckpointError(
            f"{framework}: resuming, but {root} lacks the per-rank state commhooks keeps (between syncs every rank's "
            f"weights and optimizer are its own; {framework}'s checkpoint holds rank 0's): there is none. Resume from a "
            "checkpoint written with the commhooks integration, or start a new run")
    return ck
