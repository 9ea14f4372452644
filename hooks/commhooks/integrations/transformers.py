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

import logging
import os
from typing import Optional

from transformers import TrainerCallback

from .. import ddp as ddp_adapter
from ..config import ConfigError, load_config
from ._common import config_conflicts, fill_schedule, find_ddp, load_ranks, objects_of, save_ranks

log = logging.getLogger("commhooks")


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
        self._resumed_from: Optional[str] = None  # the checkpoint folder the Trainer resumed from

    # ---------------------------------------------------------------- start
    def on_init_end(self, args, state, control, **kwargs):
        if getattr(args, "deepspeed", None):
            from . import _deepspeed_build

            _deepspeed_build.route_initialize()
        self._note_resumes()

    def _note_resumes(self) -> None:
        """Learn which checkpoint folder the Trainer resumes from: ``trainer.train(resume_from_checkpoint=...)``
        tells no callback, and the per-rank state must come from that folder, not from ``output_dir``.  The
        Trainer that holds this callback loads its optimizer from that folder in every mode
        (``_load_optimizer_and_scheduler(path)``); this Trainer's method is wrapped to note the path.  Should a
        Trainer not be found, or load elsewhere, the fingerprint check at the resume still refuses a foreign
        state."""
        import transformers

        for obj in objects_of(transformers.Trainer):
            try:
                mine = self in obj.callback_handler.callbacks
            except Exception:  # noqa: BLE001 - a weakref proxy whose object is gone, a Trainer half built
                continue
            if mine and hasattr(obj, "_load_optimizer_and_scheduler"):
                original = obj._load_optimizer_and_scheduler

                def noting(checkpoint, *args, **kwargs):
                    self._resumed_from = checkpoint
                    return original(checkpoint, *args, **kwargs)

                obj._load_optimizer_and_scheduler = noting  # this Trainer only
                return
        log.warning("CommHookCallback: the Trainer holding this callback was not found; a resume reads the "
                    "per-rank state from output_dir/checkpoint-N (a foreign one is still refused)")

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.state is not None:
            return
        if getattr(args, "deepspeed", None):
            return self._begin_deepspeed(args, state, model)
        fill_schedule(self.config, state.max_steps, args.get_warmup_steps(state.max_steps))
        ddp_model = find_ddp(model)
        if ddp_model is None:
            raise ConfigError(
                "CommHookCallback: the Trainer did not wrap the model in DistributedDataParallel (one process? launch "
                "with torchrun / accelerate launch with 2 or more processes)")
        self.state = ddp_adapter.register(ddp_model, optimizer, self.config)
        if state.global_step > 0:  # resumed: the Trainer loaded rank 0's weights and optimizer on every rank
            folder = self._folder(args, state.global_step)
            if self._resumed_from:  # the folder resumed from (beside checkpoint_root's copy, if one is given)
                folder = os.path.join(self.checkpoint_root, os.path.basename(os.path.normpath(self._resumed_from))) \
                    if self.checkpoint_root else self._resumed_from
            load_ranks(folder, model, self.state.optimizers, self.state, state.global_step, "Trainer")

    def _begin_deepspeed(self, args, state, model):
        from . import _deepspeed_build

        engine = _deepspeed_build.engine_of(model)
        if engine is None:
            off = " TrainingArguments(use_cpu=True) is set, and it switches DeepSpeed off in the Trainer;" \
                if getattr(args, "use_cpu", False) else ""
            raise ConfigError(
                f"CommHookCallback: TrainingArguments(deepspeed={args.deepspeed!r}) is set, but no DeepSpeed engine "
                f"wraps the Trainer's model ({type(model).__name__}):{off} launch with DeepSpeed on (the deepspeed "
                "launcher or torchrun, without use_cpu), or drop deepspeed= to run under DDP")
        self.state = engine.comm_hook_state
        if self.state is None:
            raise ConfigError("CommHookCallback with DeepSpeed: the engine has no comm hook; put the config in the "
                              "DeepSpeed JSON's \"comm_hook\" section (TrainingArguments(deepspeed=...))")
        differ = config_conflicts(self.config, self.state.config)
        if differ:
            raise ConfigError(
                f"CommHookCallback's config and the \"comm_hook\" section of the DeepSpeed config "
                f"({args.deepspeed!r}) disagree: "
                + "; ".join(f"{key}: {mine!r} in the callback, {theirs!r} in the JSON" for key, (mine, theirs)
                            in differ.items())
                + ". The engine runs the JSON's: give the callback the same config (or only its \"type\")")
        # the JSON's config, filled as the callback's would be: total_steps and the rule's warm-up from the Trainer
        fill_schedule(self.state.config, state.max_steps, args.get_warmup_steps(state.max_steps))
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
