"""PyTorch Lightning: any commhooks algorithm from one callback.

Your change, one line (``pip install "commhooks[frameworks]"``)::

    from commhooks.integrations.lightning import CommHookCallback

    trainer = L.Trainer(strategy="ddp", callbacks=[CommHookCallback({"type": "qsr", "h_base": 4})], ...)  # the line

Why a callback, not ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)``: Lightning registers that hook on
CUDA only (silently nothing on CPU) and wants the state before the optimizers exist.  What the callback does:

* **registers at ``on_fit_start``**, when the DDP model (``trainer.strategy.model``) and the optimizers exist;
* **drives the steps from Lightning's own hooks.**  Lightning runs forward and backward inside
  ``optimizer.step(closure)``, so an optimizer pre-hook runs *before* this step's backward and would check the
  previous step's gradients.  The NaN guard, stray reductions and the step's start run at
  ``on_before_optimizer_step`` (after the closure's backward), the step is counted after the update;
* **checkpoints every rank.**  Lightning writes rank 0's weights and optimizer; between syncs each rank's are
  its own.  At every checkpoint each rank also writes its own to ``<checkpoint dir>/commhooks/step-<N>/``, and
  a resume restores them after Lightning restored rank 0's, or is refused on every rank if they are missing;
* ``total_steps`` comes from ``max_steps`` (or the estimated stepping batches), so the run ends with a sync;
  ``on_fit_end`` ends it synced anyway.

Not supported yet: Lightning's ``"16-mixed"`` precision (a GradScaler that skips ``optimizer.step()`` on an
overflow outside the closure): refused with a ConfigError; ``"bf16-mixed"`` and ``"32"`` work.
"""

from __future__ import annotations

import os
from typing import List, Optional

import torch
from lightning.pytorch import Callback

from .. import ddp as ddp_adapter
from .. import facts, registry
from ..config import ConfigError, load_config
from ._common import fill_schedule, load_ranks, save_ranks


class CommHookCallback(Callback):
    """A Lightning ``Callback`` that runs a commhooks algorithm (``config``: object, dict, JSON path or shipped
    name) inside Lightning's DDP strategy.  ``state`` is the algorithm's state once fitting began."""

    def __init__(self, config, checkpoint_root: Optional[str] = None):
        self.config = load_config(config)
        if self.config is None:
            raise ConfigError("CommHookCallback needs an algorithm's config; {'type': 'none'} is Lightning's own DDP")
        self.checkpoint_root = checkpoint_root
        self.state = None
        self._resume: Optional[dict] = None
        self._handles: List = []

    @property
    def state_key(self) -> str:
        return "CommHookCallback"

    def _root(self, trainer) -> str:
        ckpt = trainer.checkpoint_callback
        base = self.checkpoint_root or (getattr(ckpt, "dirpath", None) if ckpt is not None else None) or \
            trainer.default_root_dir
        return str(base)

    # ---------------------------------------------------------------- start
    def on_fit_start(self, trainer, pl_module):
        if self.state is not None:
            return
        precision = str(getattr(trainer, "precision", ""))
        if precision.startswith("16"):
            raise ConfigError(
                f"CommHookCallback: Lightning precision {precision!r} (a GradScaler that skips optimizer.step() on an "
                "overflow) is not supported yet; use precision='bf16-mixed' or '32'")
        ddp_model = trainer.strategy.model
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            raise ConfigError(
                f"CommHookCallback needs Lightning's DDP strategy (strategy='ddp' on 2 or more processes); the model is "
                f"a {type(ddp_model).__name__}")
        steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        fill_schedule(self.config, int(steps) if steps != float("inf") else None, None)
        optimizers = list(trainer.optimizers)
        state_class = registry.for_config(self.config).state_class
        engine = facts.for_model(ddp_model, drives_steps=True)  # Lightning's hooks drive the steps
        self.state = state_class(optimizer=optimizers, model=ddp_model, engine=engine, config=self.config)
        ddp_model.register_comm_hook(self.state, ddp_adapter.comm_hook)
        ddp_adapter._join_includes(ddp_model, self.state)
        for opt in self.state.optimizers:
            self._handles.append(opt.register_step_post_hook(lambda o, args, kwargs: self.state.optimizer_post_step(o)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.state is not None:
            self.state.optimizer_pre_step(optimizer)  # this step's gradients are final here (after the closure)

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.state is None:
            return
        root = self._root(trainer)
        save_ranks(root, pl_module, self.state.optimizers, self.state, trainer.global_step)
        checkpoint["commhooks"] = {"root": root, "step": trainer.global_step}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._resume = checkpoint.get("commhooks") or {"root": None, "step": checkpoint.get("global_step")}

    def on_train_start(self, trainer, pl_module):
        if self._resume is None or self.state is None:
            return
        resume, self._resume = self._resume, None
        root = resume["root"] if resume["root"] and os.path.isdir(os.path.join(resume["root"], "commhooks")) else \
            self._root(trainer)
        load_ranks(root, pl_module, self.state.optimizers, self.state, resume["step"], "Lightning")

    # -------------------------------------------------------------------- end
    def on_fit_end(self, trainer, pl_module):
        if self.state is not None:
            self.state.finish()
            for h in self._handles:
                h.remove()
            self._handles = []
