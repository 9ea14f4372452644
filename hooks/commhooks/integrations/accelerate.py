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
  ``save_state`` each rank also writes its weights, optimizer and hook state to ``dir/commhooks/``, and after
  ``accelerator.load_state(dir)`` each rank restores its own over rank 0's, or every rank raises if they are
  missing (a silent divergence otherwise).

Launch as Accelerate users do: ``accelerate launch --num_processes 2 script.py`` on GPUs; on CPUs
``ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 script.py`` (``accelerate launch --cpu`` starts one process).
"""

from __future__ import annotations

from .. import ddp as ddp_adapter
from ..config import ConfigError
from ._common import find_ddp, load_ranks, save_ranks


def register(accelerator, model, optimizer, config, scaler=None):
    """The algorithm's state for ``config`` on the prepared ``model`` (DDP) and ``optimizer``; every rank's state
    saved and restored with ``accelerator.save_state`` / ``load_state``.  Call on every rank, after ``prepare``."""
    ddp_model = find_ddp(model)
    if ddp_model is None:
        raise ConfigError(
            "commhooks.integrations.accelerate.register needs the model accelerator.prepare returned, wrapped in "
            "DistributedDataParallel (2 or more processes: accelerate launch --num_processes N, or "
            "ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N on CPUs)")
    state = ddp_adapter.register(ddp_model, optimizer, config, scaler=scaler)
    if not hasattr(state, "state_dict"):  # {"type": "none"}: DDP's allreduce, the ranks never differ
        return state
    module = ddp_model.module
    loading = {}

    def save_every_rank(models, weights, output_dir):
        save_ranks(output_dir, module, state.optimizers, state, state.step)

    def note_input_dir(models, input_dir):
        loading["dir"] = input_dir

    accelerator.register_save_state_pre_hook(save_every_rank)
    accelerator.register_load_state_pre_hook(note_input_dir)
    original_load = accelerator.load_state

    def load_state(*args, **kwargs):
        out = original_load(*args, **kwargs)  # rank 0's model and optimizer on every rank, the RNGs, the scheduler
        load_ranks(loading["dir"], module, state.optimizers, state, None, "Accelerate")
        return out

    accelerator.load_state = load_state  # this accelerator only
    return state
