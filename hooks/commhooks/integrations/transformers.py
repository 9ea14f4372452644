"""Hugging Face ``Trainer``: any commhooks algorithm from one callback.

Your change, one line (``pip install "commhooks[frameworks]"``)::

    from commhooks.integrations.transformers import CommHookCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[CommHookCallback({"type": "qsr", "h_base": 4, "alpha": 0.01})])   # the line

What the callback does, and why (each was a silent problem with a hand-written one):

* **Finds the DDP model.**  Callbacks get the unwrapped model; the Trainer's ``model_wrapped`` (DDP) is found
  at ``on_train_begin`` and the hook registered on it, with the torch optimizer inside Accelerate's wrapper.
* **Fills the schedule keys.**  ``total_steps`` from the run's ``max_steps`` (so the run ends with a sync) and,
  for the rule's ``warmup_steps``, the Trainer's own lr warm-up (it starts at lr 0: a rule reading a warm-up
  lr would choose one endless period), unless the config sets them.
* **Checkpoints every rank.**  The Trainer saves rank 0's model and optimizer; between syncs each rank's are
  its own.  At every save each rank writes its weights, optimizer state and hook state into
  ``checkpoint-<step>/commhooks/``; a resume restores them over what the Trainer loaded, or is refused on
  every rank if they are missing (a silent divergence otherwise).
* **DeepSpeed** (``TrainingArguments(deepspeed=ds.json)`` with a ``"comm_hook"`` section): the engine is
  built through :func:`commhooks.deepspeed.initialize` (replica groups, the global batch kept), the hook is
  the engine's own, and the Trainer's own DeepSpeed checkpoint is written per replica group (the first in
  ``checkpoint-<step>/`` as usual, the others in ``checkpoint-<step>/replica<g>/``: the replicas would
  otherwise write the same files) with every rank's hook state; the Trainer's resume reads them back.
"""

from __future__ import annotations

import os
from typing import Optional

from transformers import TrainerCallback

from .. import ddp as ddp_adapter
from ..config import ConfigError, load_config
from ._common import fill_schedule, find_ddp, load_ranks, save_ranks

class CommHookCallback(TrainerCallback):
    """A ``TrainerCallback`` that runs a commhooks algorithm (``config``: object, dict, JSON path or shipped name)
    inside the Trainer's DDP or DeepSpeed engine.  ``state`` is the algorithm's state once training began."""

    def __init__(self, config, checkpoint_root: Optional[str] = None):
        self.config = load_config(config)
        if self.config is None:
            raise ConfigError("CommHookCallback needs an algorithm's config; {'type': 'none'} is the Trainer itself")
        self.checkpoint_root = checkpoint_root  # where checkpoint-<step> folders are (default: args.output_dir)
        self.state = None
        self._deepspeed = None

    # ---------------------------------------------------------------- start
    def on_init_end(self, args, state, control, **kwargs):
        if getattr(args, "deepspeed", None):
            from . import _deepspeed_build

            _deepspeed_build.route_initialize()

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.state is not None:
            return
        filled = fill_schedule(self.config, state.max_steps, args.get_warmup_steps(state.max_steps))
        if getattr(args, "deepspeed", None):
            return self._begin_deepspeed(args, state, model, filled)
        ddp_model = find_ddp(model)
        if ddp_model is None:
            raise ConfigError(
                "CommHookCallback: the Trainer did not wrap the model in DistributedDataParallel (one process? launch "
                "with torchrun / accelerate launch with 2 or more processes)")
        self.state = ddp_adapter.register(ddp_model, optimizer, self.config)
        if state.global_step > 0:  # resumed: the Trainer loaded rank 0's weights and optimizer on every rank
            load_ranks(self._folder(args, state.global_step), model, self.state.optimizers, self.state,
                       state.global_step, "Trainer")

    def _begin_deepspeed(self, args, state, model, filled):
        from . import _deepspeed_build

        engine = _deepspeed_build.engine_of(model)
        self.state = engine.comm_hook_state
        if self.state is None:
            raise ConfigError("CommHookCallback with DeepSpeed: the engine has no comm hook; put the config in the "
                              "DeepSpeed JSON's \"comm_hook\" section (TrainingArguments(deepspeed=...))")
        for key, value in filled.items():
            if getattr(self.state.config, key) is None:
                setattr(self.state.config, key, value)
        self._deepspeed = engine  # the Trainer saves and resumes it (per replica group, with the hook's state)

    # ------------------------------------------------------------ checkpoints
    def _folder(self, args, step: int) -> str:
        return os.path.join(self.checkpoint_root or args.output_dir, f"checkpoint-{step}")

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.state is None:
            return
        if self._deepspeed is not None:
            return  # the Trainer's engine.save_checkpoint wrote every replica group and every rank's hook state
        save_ranks(self._folder(args, state.global_step), model, self.state.optimizers, self.state, state.global_step)

    # -------------------------------------------------------------------- end
    def on_train_end(self, args, state, control, **kwargs):
        if self.state is not None:
            self.state.finish()  # the run ends synced, whatever its length
