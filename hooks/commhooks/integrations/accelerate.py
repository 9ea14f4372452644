"""Hugging Face Accelerate: any commhooks algorithm with one call after ``accelerator.prepare``.

Your change (``pip install "commhooks[frameworks]"``)::

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    state = commhooks.integrations.accelerate.register(accelerator, model, optimizer, {"type": "qsr", "h_base": 4})
    with state:                        # the run ends synced
        for batch in loader: ...       # your loop, unchanged

Why not ``DistributedDataParallelKwargs(comm_hook=...)``: Accelerate accepts only PyTorch's own hook enum
there and silently registers nothing else.  What ``register`` does:

* registers the hook on the prepared DDP model, with the torch optimizer inside ``AcceleratedOptimizer``
  (its step hooks must sit where ``step()`` really runs);
* checkpoints every rank: ``accelerator.save_state(dir)`` writes rank 0's model and optimizer (and
  ``register_for_checkpointing`` objects from rank 0 too); between syncs each rank's are its own, so at every
  ``save_state`` each rank also writes its weights, optimizer and hook state to ``dir/commhooks/`` (the newest
  only: saving into one folder again and again keeps one), with a fingerprint of rank 0's weights; after
  ``accelerator.load_state(dir)`` each rank restores its own over rank 0's, or every rank raises if they are
  missing or were saved beside other weights (a silent divergence otherwise).  ``load_state`` may come before
  ``register`` (as in Hugging Face's example scripts): ``register`` then restores each rank's state from the
  folder ``load_state`` read.  A ``load_state`` that ran before this module was imported is refused on every rank
  (the folder it read is unknown): the optimizer Accelerate saved carries the hook's step, so even an optimizer
  that keeps no state (SGD without momentum) shows it.

Launch as Accelerate users do: ``accelerate launch --num_processes 2 script.py`` on GPUs; on CPUs
``ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 script.py`` (``accelerate launch --cpu`` starts one process).
"""

from __future__ import annotations

from accelerate import Accelerator

from .. import ddp as ddp_adapter
from ..config import ConfigError
from ._common import find_ddp, load_ranks, save_ranks

_LOADED_FROM = "_commhooks_loaded_from"  # on an Accelerator: the folder its last load_state read
_SAVED_STEP = "commhooks_step"  # in a saved optimizer's first param group: the hook's step at that save


def _note_loads() -> None:
    """Every ``Accelerator.load_state`` notes the folder it read on its accelerator, so that :func:`register`,
    called after it (where Hugging Face's example scripts put ``load_state``: right after ``prepare``), restores
    each rank's own state from there.  Installed when this module is imported (before a script's
    ``load_state``); it changes nothing else."""
    if getattr(Accelerator.load_state, "_commhooks_notes", False):
        return
    original = Accelerator.load_state

    def load_state(self, input_dir=None, *args, **kwargs):
        seen = {}  # the folder Accelerate resolved (automatic checkpoint naming, ~), as its pre-hooks see it
        handle = self.register_load_state_pre_hook(lambda models, folder: seen.setdefault("dir", folder))
        try:
            out = original(self, input_dir, *args, **kwargs)
        finally:
            handle.remove()
        setattr(self, _LOADED_FROM, seen.get("dir", input_dir))
        return out

    load_state._commhooks_notes = True
    load_state.__wrapped__ = original
    load_state.__doc__ = original.__doc__
    Accelerator.load_state = load_state


_note_loads()


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside what ``prepare`` returned (one, or a list)."""
    return [getattr(o, "optimizer", o) for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])]


def _mark_saves(optimizers, state) -> None:
    """Every ``state_dict`` of ``optimizers`` carries the hook's step in its first param group (torch keeps a saved
    group's unknown keys on load and ignores them in ``step``).  ``load_state`` loads rank 0's optimizer on every
    rank, so a load commhooks did not see (this module imported after it) still leaves the step on every rank's
    optimizer, even one that keeps no state (SGD without momentum), where :func:`register` finds it."""
    def mark(optimizer, state_dict):
        if state_dict["param_groups"]:
            state_dict["param_groups"][0][_SAVED_STEP] = int(state.step)
        return state_dict

    for optimizer in optimizers:
        optimizer.register_state_dict_post_hook(mark)


def _take_saved_step(optimizers):
    """The hook's step a loaded commhooks checkpoint left in ``optimizers`` (:func:`_mark_saves`), or None; taken out
    of the live param groups, so that a later save marks its own step and nothing else reads it."""
    found = None
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            step = group.pop(_SAVED_STEP, None)
            found = step if step is not None else found
    return found


def _refuse_an_unseen_load(saved, optimizers) -> None:
    """Refused on every rank (each loaded rank 0's optimizer: no collective, no hang): an optimizer loaded from a
    commhooks checkpoint (``saved``: the hook's step there) or holding state, with no ``load_state`` noted.
    Registering would go on from rank 0's weights and optimizer with the hook at step 0, a silent restart; the
    folder that load read is unknown, so each rank's own state cannot be found."""
    if saved is None and not any(s for o in optimizers for s in o.state.values()):
        return
    what = (f"the optimizer comes from a commhooks checkpoint (the hook at step {saved} there)" if saved is not None
            else "the optimizer already holds state")
    raise ConfigError(
        f"commhooks.integrations.accelerate.register: {what}, but no accelerator.load_state was seen (it ran "
        "before commhooks.integrations.accelerate was imported, or the model trained before register): the ranks "
        "would go on from rank 0's weights and optimizer with the hook at step 0. Import "
        "commhooks.integrations.accelerate at the top of the script, before load_state (register then restores "
        "each rank's state from the folder load_state read), or call register right after prepare")


def _sharded(model) -> bool:
    """Whether Accelerate's FSDP plugin (FSDP2's ``fully_shard`` or FSDP1's wrapper) shards ``model``."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


def register(accelerator, model, optimizer, config, scaler=None):
    """The algorithm's state for ``config`` on the prepared ``model`` (DDP) and ``optimizer``; every rank's state
    saved and restored with ``accelerator.save_state`` / ``load_state``.  Call on every rank, after ``prepare``;
    before or after ``load_state`` (after it, each rank's own state is restored here)."""
    ddp_model = find_ddp(model)
    if ddp_model is None and _sharded(model):
        raise ConfigError(
            "commhooks.integrations.accelerate.register: the model is sharded by Accelerate's FSDP plugin, which "
            "shards over every rank (or, with dp_replicate_size, is FSDP2's own HSDP, all-reducing across the "
            "replicas every step): there are no replica groups for commhooks to sync. Accelerate's FSDP is not "
            "integrated yet: shard with FSDP2 over commhooks.fsdp.replica_mesh(group_size)['shard'] in your own "
            "loop and call commhooks.fsdp.register (docs: engines/fsdp.md), or use Accelerate's DDP")
    if ddp_model is None:
        raise ConfigError(
            "commhooks.integrations.accelerate.register needs the model accelerator.prepare returned, wrapped in "
            "DistributedDataParallel (2 or more processes: accelerate launch --num_processes N, or "
            "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N on CPUs)")
    loaded_from = getattr(accelerator, _LOADED_FROM, None)
    optimizers = _torch_optimizers(optimizer)
    saved = _take_saved_step(optimizers)  # read before anything else sees the groups
    if loaded_from is None:
        _refuse_an_unseen_load(saved, optimizers)
    state = ddp_adapter.register(ddp_model, optimizer, config, scaler=scaler)
    if not hasattr(state, "state_dict"):  # {"type": "none"}: DDP's allreduce, the ranks never differ
        return state
    module = ddp_model.module
    _mark_saves(state.optimizers, state)

    def save_every_rank(models, weights, output_dir):  # one checkpoint's worth per folder saved into
        save_ranks(output_dir, module, state.optimizers, state, state.step, keep=1)

    def load_every_rank() -> None:  # from the folder the last load_state read (noted by _note_loads)
        folder = getattr(accelerator, _LOADED_FROM)
        setattr(accelerator, _LOADED_FROM, None)
        load_ranks(folder, module, state.optimizers, state, None, "Accelerate")
        _take_saved_step(state.optimizers)  # the step load_state (and the per-rank files) brought: read, not kept

    accelerator.register_save_state_pre_hook(save_every_rank)
    original_load = accelerator.load_state

    def load_state(*args, **kwargs):
        out = original_load(*args, **kwargs)  # rank 0's model and optimizer on every rank, the RNGs, the scheduler
        load_every_rank()
        return out

    accelerator.load_state = load_state  # this accelerator only
    if loaded_from is not None:  # load_state ran before register: each rank's own state now
        load_every_rank()
    return state
