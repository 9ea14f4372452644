"""What the framework integrations share: finding the DDP model a framework keeps, and per-rank checkpoints
beside the framework's own."""

from __future__ import annotations

import gc
import os
import warnings
from typing import List, Optional

import torch

from ..algorithms.contract.checks import fingerprint
from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..config import to_dict

SUBDIR = "commhooks"  # inside a framework's checkpoint folder: step-<N>/rank<r>.pt, manifest.json, latest


def fill_schedule(conf, max_steps: int, warmup: int) -> dict:
    """The config's schedule keys (``schedule_keys``: total_steps, the rule's warmup_steps) left unset, from the
    Trainer's run; returns what was filled."""
    values = {"total": max_steps, "warmup": warmup}
    filled, idle = {}, conf.inactive_keys()  # (a key that would change nothing is not filled)
    for key, what in getattr(type(conf), "schedule_keys", {}).items():
        unset = key not in conf.model_fields_set or getattr(conf, key) is None
        if unset and values.get(what) is not None and key not in idle:
            setattr(conf, key, int(values[what]))
            filled[key] = int(values[what])
    return filled


def lr_warmup_steps(scheduler, limit: int) -> Optional[int]:
    """How many steps ``scheduler`` raises the lr (of its optimizer's first group) before it stops rising: its
    warm-up, for a framework that knows the scheduler but not its warm-up (Lightning).  Found by stepping the
    scheduler up to ``limit`` times (until the lr falls, or stays put for 1000 steps) and putting everything back
    as it was: the scheduler's ``state_dict`` and every setting of every param group (lr, momentum, betas: a
    one-cycle scheduler moves those too; tensor values are written back in place).  None when the lr never
    rises."""
    optimizer = scheduler.optimizer
    saved = scheduler.state_dict()
    groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]
    current = lambda: float(optimizer.param_groups[0]["lr"])  # noqa: E731 - a float, or a tensor's value
    best, peak, flat, seen = current(), 0, 0, current()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": this is a probe
            for step in range(1, limit + 1):
                scheduler.step()
                lr = current()
                if lr < seen:
                    break
                flat = flat + 1 if lr == seen else 0
                if lr > best:
                    best, peak = lr, step
                if flat >= 1000:
                    break
                seen = lr
    except Exception:  # noqa: BLE001 - a scheduler with a fixed length (OneCycleLR) past its end: what was seen
        pass
    finally:
        scheduler.load_state_dict(saved)
        for group, settings in zip(optimizer.param_groups, groups):
            for key, value in settings.items():
                if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                    group[key].copy_(value)
                else:
                    group[key] = value
    return peak or None


def config_conflicts(mine, theirs) -> dict:
    """The keys a user set in ``mine`` (and its ``type``) whose values ``theirs`` does not share:
    ``{key: (mine's, theirs)}``."""
    a, b = to_dict(mine), to_dict(theirs)
    keys = ["type"] + sorted(k for k in mine.model_fields_set if k != "type")
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


def objects_of(cls) -> list:
    """Every live object of ``cls`` (a framework keeps the engine it built to itself: found among the garbage
    collector's objects).  The scan asks every object its class, and a few of torch's deprecated names warn when
    asked (``torch.distributed.reduce_op``): their warnings are not the user's business, so the scan is quiet."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = []
        for obj in gc.get_objects():
            try:
                if isinstance(obj, cls):
                    found.append(obj)
            except ReferenceError:  # a weakref proxy whose object is gone
                continue
        return found


def find_ddp(module: torch.nn.Module) -> Optional[torch.nn.parallel.DistributedDataParallel]:
    """The ``DistributedDataParallel`` wrapping ``module`` (frameworks hand callbacks the unwrapped module and
    keep the DDP one to themselves); ``module`` itself if it is one; None if there is none."""
    ddp_class = torch.nn.parallel.DistributedDataParallel
    if isinstance(module, ddp_class):
        return module
    return next((obj for obj in objects_of(ddp_class) if obj.module is module), None)


def _fingerprint(model, device) -> torch.Tensor:
    """Weights summarised: their sum, their position-weighted sum (:func:`~commhooks.algorithms.contract.checks.
    fingerprint`) and the sum of their magnitudes, in float64 on ``device``."""
    params = [p.detach() for p in getattr(model, "module", model).parameters()]
    size = torch.stack([p.double().abs().sum().to(device) for p in params]).sum().reshape(1)
    return torch.cat([fingerprint(params, device), size])


def same_weights(a: List[float], b: List[float]) -> bool:
    """Whether two fingerprints describe the same weights: equal to 1e-9 of the weights' magnitude (a GPU of
    another kind sums in another order; another run's or checkpoint's weights differ by far more)."""
    return len(a) == len(b) == 3 and all(abs(x - y) <= 1e-9 * max(a[2], b[2], 1.0) for x, y in zip(a, b))


def rank0_value(state, values: torch.Tensor) -> List[float]:
    """Rank 0's ``values`` on every rank, read on the host: an unmetered sum in which the other ranks add zeros
    (exact; a broadcast would be metered as the algorithm's traffic).  Collective."""
    if state.comm.rank != 0:
        values.zero_()
    if state.comm.size > 1:
        state.comm.allreduce([values], op="sum", tag="checkpoint", metered=False)
    return values.tolist()


def _rank0_fingerprint(model, state) -> List[float]:
    """Rank 0's :func:`_fingerprint` on every rank (the framework saves rank 0's weights); collective."""
    return rank0_value(state, _fingerprint(model, state.comm.device))


def save_ranks(folder: str, model, optimizer, state, step: int, keep: int = 0, where: Optional[str] = None) -> str:
    """Every rank's weights, optimizer state and hook state for ``step``, in ``folder/commhooks`` (collective),
    with the fingerprint of the weights the framework saves (rank 0's), which ties them to its checkpoint.
    ``keep``: the newest complete ones kept there (0: all; a folder the framework saves into again and again:
    1); ``where``: write there instead.  Returns the folder written into."""
    root = where or os.path.join(folder, SUBDIR)
    save_checkpoint(root, model, optimizer, state, step=step, keep=keep,
                    extra={"framework_weights": _rank0_fingerprint(model, state)})
    return root


def load_ranks(folder: str, model, optimizer, state, step: Optional[int], framework: str,
               where: Optional[str] = None) -> dict:
    """Restore this rank's own weights, optimizer and hook state of ``step`` (None: the one there) from
    ``folder/commhooks`` (or ``where``) over what the framework loaded (rank 0's); collective.

    Refused on every rank, naming both, when there are none (resuming the ranks from rank 0's model and
    optimizer with the hook at another step ends with different models), and when they were saved with other
    weights than the framework's checkpoint holds (another run's, or another checkpoint's: their fingerprint
    of rank 0's weights at the save differs from the weights the framework restored)."""
    root = where or os.path.join(folder, SUBDIR)
    restored = _fingerprint(model, state.comm.device).tolist()  # rank 0's, as the framework loaded them everywhere
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
    saved = (ck.get("extra") or {}).get("framework_weights")
    foreign = torch.tensor([0.0 if saved is None or same_weights([float(v) for v in saved], restored) else 1.0],
                           device=state.comm.device)
    if state.comm.size > 1:  # every rank decides alike, from the same two fingerprints: say it together anyway
        state.comm.allreduce([foreign], op="max", tag="checkpoint", metered=False)
    if foreign.tolist()[0]:
        saved = saved or []
        raise CheckpointError(
            f"{framework}: the per-rank state in {root} (step {ck['step']}) was saved beside other weights than the "
            f"{framework} checkpoint being resumed holds (rank 0's weights, fingerprint {restored}; at that save "
            f"{[float(v) for v in saved]}): it belongs to another run or another checkpoint. Resume from the "
            f"checkpoint it was written with, or start a new run")
    return ck
