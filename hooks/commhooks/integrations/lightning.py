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
  its own.  At every checkpoint each rank also writes its own to ``<checkpoint dir>/commhooks/run-<id>/step-<N>/``
  (``<id>`` new at every fit: two runs in one folder never share one), and the ``.ckpt`` records that folder
  and a fingerprint of the weights it holds.  A resume restores the per-rank state the ``.ckpt`` names after
  Lightning restored rank 0's, or is refused on every rank, naming the folder, if it is missing or was saved
  beside other weights.  Folders no ``.ckpt`` in the checkpoint directory names any more (``save_top_k``)
  are removed at the next save and at the end of the fit;
* ``total_steps`` comes from ``max_steps`` (or the estimated stepping batches), so the run ends with a sync;
  ``on_fit_end`` ends it synced anyway; the rule's ``warmup_steps`` from the lr scheduler's warm-up (the steps
  until its lr stops rising), for a scheduler stepped per step.

Not supported yet: Lightning's ``"16-mixed"`` precision (a GradScaler that skips ``optimizer.step()`` on an
overflow outside the closure): refused with a ConfigError; ``"bf16-mixed"`` and ``"32"`` work.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import List, Optional

import torch
from lightning.pytorch import Callback

from .. import ddp as ddp_adapter
from .. import facts, registry
from ..config import ConfigError, load_config
from ._common import SUBDIR, fill_schedule, load_ranks, lr_warmup_steps, rank0_value, save_ranks


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
        self._run_id: Optional[str] = None

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
        self._run_id = None  # every fit writes its own run folder
        if self.state is not None:
            return
        precision = str(getattr(trainer, "precision", ""))
        if precision.startswith("16"):
            raise ConfigError(
                f"CommHookCallback: Lightning precision {precision!r} (a GradScaler that skips optimizer.step() on an "
                "overflow) is not supported yet; use precision='bf16-mixed' or '32'")
        ddp_model = trainer.strategy.model
        if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
            strategy = type(trainer.strategy).__name__
            sharded = any(word in strategy for word in ("FSDP", "ModelParallel", "DeepSpeed"))
            raise ConfigError(
                f"CommHookCallback needs Lightning's DDP strategy (strategy='ddp' on 2 or more processes); this "
                f"Trainer's strategy is {strategy}, whose model is a {type(ddp_model).__name__}"
                + (": commhooks does not run over a sharded model (FSDP, ModelParallelStrategy, DeepSpeed) inside "
                   "Lightning yet (its FSDP shards over the whole world or as FSDP2's own HSDP, which all-reduces "
                   "across replicas every step); use strategy='ddp', or FSDP2 in your own loop with commhooks.fsdp "
                   "(docs: engines/fsdp.md)" if sharded else ""))
        steps = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else trainer.estimated_stepping_batches
        steps = int(steps) if steps != float("inf") else None
        unset = "warmup_steps" in getattr(type(self.config), "schedule_keys", {}) and (
            "warmup_steps" not in self.config.model_fields_set)
        fill_schedule(self.config, steps, self._warmup(trainer, steps) if unset else None)
        optimizers = list(trainer.optimizers)
        state_class = registry.for_config(self.config).state_class
        engine = facts.for_model(ddp_model, drives_steps=True)  # Lightning's hooks drive the steps
        self.state = state_class(optimizer=optimizers, model=ddp_model, engine=engine, config=self.config)
        ddp_model.register_comm_hook(self.state, ddp_adapter.comm_hook)  # join includes the state (facts' attach)
        for opt in self.state.optimizers:
            self._handles.append(opt.register_step_post_hook(lambda o, args, kwargs: self.state.optimizer_post_step(o)))

    @staticmethod
    def _warmup(trainer, steps: Optional[int]) -> Optional[int]:
        """The lr warm-up of the first per-step scheduler in ``configure_optimizers`` (Lightning knows the
        scheduler, not its warm-up): the steps until its lr stops rising (:func:`lr_warmup_steps`).  A scheduler
        stepped per epoch, or none: None (the rule's own warning then says the warm-up is unset)."""
        for config in getattr(trainer, "lr_scheduler_configs", None) or []:
            if config.interval == "step" and getattr(config.scheduler, "optimizer", None) is not None:
                found = lr_warmup_steps(config.scheduler, min(steps or 20000, 20000))
                return None if found is None else found * (config.frequency or 1)
        return None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.state is not None:
            self.state.optimizer_pre_step(optimizer)  # this step's gradients are final here (after the closure)

    # ------------------------------------------------------------ checkpoints
    def _run_folder(self, trainer) -> str:
        """This fit's folder of per-rank states: ``<checkpoint dir>/commhooks/run-<id>``, the id drawn by rank 0
        at the first save and shared (:func:`rank0_value`)."""
        if self._run_id is None:
            token = torch.tensor([float(random.SystemRandom().getrandbits(31))], dtype=torch.float64,
                                 device=self.state.comm.device)
            self._run_id = f"run-{int(rank0_value(self.state, token)[0]):08x}"
        return os.path.join(self._root(trainer), SUBDIR, self._run_id)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.state is None:
            return
        self._prune(trainer)
        folder = self._run_folder(trainer)
        save_ranks(folder, pl_module, self.state.optimizers, self.state, trainer.global_step, where=folder)
        checkpoint["commhooks"] = {"dir": folder, "run": self._run_id, "step": trainer.global_step}

    def _prune(self, trainer) -> None:
        """Remove this fit's per-rank checkpoints that no ``.ckpt`` in the checkpoint directory names any more
        (Lightning removed it: ``save_top_k``), on rank 0; never this fit's newest, never another fit's folder.
        Each ``.ckpt``'s record is read memory-mapped (its tensors are not loaded).  Nothing is removed when a
        ``.ckpt`` cannot be read, or while checkpoints are written in the background (``AsyncCheckpointIO``: the
        newest ``.ckpt`` may not be there yet)."""
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        if self.state is None or self.state.comm.rank != 0 or self._run_id is None or not dirpath \
                or not os.path.isdir(dirpath) or "Async" in type(getattr(trainer.strategy, "checkpoint_io", None)).__name__:
            return
        run = Path(self._root(trainer), SUBDIR, self._run_id)
        steps = {}
        for folder in run.glob("step-*"):
            try:
                steps[int(folder.name[len("step-"):])] = folder
            except ValueError:
                continue
        if len(steps) < 2:
            return
        named = set()
        for ckpt in Path(dirpath).glob("*.ckpt"):
            try:
                record = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True).get("commhooks") or {}
            except Exception:  # noqa: BLE001 - being written, not Lightning's, or holding more than data (no
                return  # foreign code is run to find out): remove nothing
            if record.get("run") == self._run_id:
                named.add(int(record["step"]))
        newest = max(steps)
        for step, folder in steps.items():
            if step != newest and step not in named:
                shutil.rmtree(folder, ignore_errors=True)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._resume = checkpoint.get("commhooks") or {"dir": None, "step": checkpoint.get("global_step")}

    def on_train_start(self, trainer, pl_module):
        if self._resume is None or self.state is None:
            return
        resume, self._resume = self._resume, None
        if resume.get("dir"):  # the folder the .ckpt names; moved with the .ckpt: beside it
            where = resume["dir"]
            moved = os.path.join(os.path.dirname(str(getattr(trainer, "ckpt_path", None) or "")), SUBDIR,
                                 resume.get("run") or "")
            if not os.path.isdir(where) and resume.get("run") and os.path.isdir(moved):
                where = moved
            load_ranks(where, pl_module, self.state.optimizers, self.state, resume["step"], "Lightning", where=where)
        else:  # written before run folders (<root>/commhooks/step-N), or by no commhooks callback: refused there
            root = resume.get("root") or self._root(trainer)
            load_ranks(root, pl_module, self.state.optimizers, self.state, resume["step"], "Lightning")

    # -------------------------------------------------------------------- end
    def on_fit_end(self, trainer, pl_module):
        if self.state is not None:
            self._prune(trainer)
            self.state.finish()
            for h in self._handles:
                h.remove()
            self._handles = []
