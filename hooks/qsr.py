"""Local SGD / local AdamW gated by the Quadratic Synchronisation Rule.

Gu, Lyu, Arora, Zhang, Huang, "A Quadratic Synchronization Rule for
Distributed Deep Learning", ICLR 2024 (arXiv 2310.14423).

Every rank runs its own optimizer on its own data; no gradient crosses the
network.  After ``H`` optimizer steps the ranks average their parameters
(one flat allreduce), and the next period is chosen from the learning rate
the next step will use::

    H = init_h                                            while step < warmup_steps
    H = max(1, min(total_steps - step,
                   max(h_base, floor((alpha / lr) ** power))))   otherwise

``power=2`` is QSR; 1 and 3 are the comparison rules of the paper; ``alpha=0``
is constant-period local SGD.  As the lr decays, H grows quadratically, so
communication thins out exactly when it matters least for accuracy (the paper
shows it even improves generalisation).

Paper settings: ViT-B / local AdamW, ``h_base=4, alpha=0.0175``, peak lr
0.008, cosine decay, 10k warm-up steps: syncs on ~10 % of the steps instead of
25 % for constant H=4, with higher top-1 accuracy.

Tuning advice:

* ``h_base`` bounds the drift at peak lr; 2-8 is the useful range.
* ``alpha`` sets where the rule takes over: ``(alpha/lr)**2 > h_base`` once
  ``lr < alpha / sqrt(h_base)``.  The paper's ViT setting puts that point at
  the peak lr (``alpha ~ peak_lr * sqrt(h_base)``); on MNIST-1D here (AdamW,
  peak lr 0.003, h_base 4) alpha 0.006 syncs on 11 % of the steps and 0.01
  on 4.7 %, both at DDP's accuracy.
* ``warmup_steps`` must cover the lr warm-up: a tiny warm-up lr would give a
  huge first period.
* Leave ``average_optimizer_state`` off (the paper's code averages parameters
  only); turn it on if local Adam moments drift apart on very skewed data.
* BatchNorm running statistics are averaged at each sync
  (``average_buffers``); integer buffers such as ``num_batches_tracked`` are
  left alone.

This module is plain tensor math over a :class:`~commhooks.comm.Comm`; it
imports no engine.  The DDP, Horovod and DeepSpeed adapters call
:meth:`QSRState.begin_step` / :meth:`QSRState.end_step` through optimizer
step hooks.
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional

import torch

from ._version import __version__
from .averaging import average_, buffers_broadcast_each_forward, float_buffers, optimizer_moments
from .comm import Comm
from .config import ConfigError, QSRConfig, from_dict, load_config, to_dict
from .consistency import guard_gradients, verify_identical, verify_same_everywhere

NEVER = 2**62  # a period that never ends (lr 0 and no total_steps)


def quadratic_rule(lr: float, alpha: float, h_base: int, power: float = 2.0) -> float:
    """``max(h_base, floor((alpha / lr) ** power))``; ``alpha = 0`` gives ``h_base``, ``lr <= 0`` infinity."""
    if alpha == 0.0:
        return h_base
    if lr <= 0.0:
        return math.inf  # a zero lr makes local steps free of drift
    ratio = (alpha / lr) ** power
    return max(h_base, math.floor(ratio) if math.isfinite(ratio) else math.inf)


def qsr_period(step: int, lr: float, config: QSRConfig) -> int:
    """The synchronisation period for the round that starts at ``step``.

    ``step`` is the number of optimizer steps already done; ``lr`` is the
    learning rate of the round's first step.
    """
    if step < config.warmup_steps:
        return config.warmup_h
    h = quadratic_rule(lr, config.alpha, config.h_base, config.power)
    if config.total_steps is not None:
        h = min(config.total_steps - step, h)
    return max(1, int(min(h, NEVER)))


def sync_tensors(
    optimizer: torch.optim.Optimizer,
    module: Optional[torch.nn.Module] = None,
    average_buffers: bool = True,
    average_optimizer_state: bool = False,
) -> List[torch.Tensor]:
    """The tensors a local-SGD sync averages: parameters, float buffers, optionally optimizer moments."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    tensors = list(params)
    if average_buffers:
        tensors += float_buffers(module)
    if average_optimizer_state:
        tensors += optimizer_moments(optimizer, params)
    return tensors


class QSRState:
    """Hook state for QSR-gated local SGD; registers its own optimizer step hooks.

    Two lines after building the DDP model and the optimizer::

        state = commhooks.QSRState(optimizer, model=ddp_model, alpha=0.0175, h_base=4)
        ddp_model.register_comm_hook(state, commhooks.qsr_hook)

    ``model`` is optional: give it so BatchNorm buffers are averaged and
    ``broadcast_buffers`` is checked.  Keyword arguments are the fields of
    :class:`~commhooks.config.QSRConfig`; ``config=`` takes a config object,
    dict or JSON path instead.

    Steps are counted by the optimizer post-hook, so ``no_sync()`` gradient
    accumulation counts optimizer steps, not micro-batches.  The period of a
    round is chosen in the pre-hook of its first step, i.e. after your
    ``scheduler.step()`` has set the lr that step really uses.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: Optional[torch.nn.Module] = None,
        process_group=None,
        comm: Optional[Comm] = None,
        config=None,
        **settings,
    ):
        if config is not None and settings:
            raise ConfigError(f"pass either config= or keyword settings, not both (got {sorted(settings)})")
        self.config: QSRConfig = (
            load_config(config, kind="qsr") if config is not None else from_dict(settings, kind="qsr", where="QSRState")
        )
        if self.config is None:
            raise ConfigError("QSRState needs a 'qsr' config, got type 'none'")
        self.optimizer = optimizer
        self.model = model
        if comm is None:
            from .comm.torch_dist import TorchComm

            comm = TorchComm(process_group, timeout_s=self.config.timeout_s)
        self.comm = comm
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._named = [(names.get(id(p), f"param{i}"), p) for i, p in enumerate(params)]
        verify_same_everywhere(comm, "the QSR hook", {"config": to_dict(self.config), "world": comm.size,
                                                      "params": [tuple(p.shape) for p in params], "version": __version__})
        self.step = 0
        self.since_sync = 0
        self.H: Optional[int] = None  # chosen at the first step of each round
        self.syncs = 0
        self.skipped_steps = 0
        self.sync_steps: List[int] = []  # optimizer steps after which a sync happened (this process)
        if model is not None and buffers_broadcast_each_forward(model):
            warnings.warn(
                "the DDP model re-broadcasts buffers from rank 0 on every forward "
                "(broadcast_buffers / forward_sync_buffers=True): that is traffic on every step "
                "and overrides the local buffers; build DDP with forward_sync_buffers=False "
                "(torch>=2.13) or broadcast_buffers=False, QSR averages buffers at each sync",
                stacklevel=2,
            )
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.begin_step()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.end_step()),
        ]

    @property
    def meter(self):
        return self.comm.meter

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def begin_step(self) -> None:
        """Called before each optimizer step: guard against NaN/Inf gradients, pick H at a round's first step."""
        if guard_gradients(self._named, self.config.nonfinite, self.step, self.comm.rank):
            self.skipped_steps += 1
        if self.H is None:
            self.H = qsr_period(self.step, self.lr(), self.config)

    def end_step(self) -> bool:
        """Called after each optimizer step: count it, sync when the round is over."""
        if self.H is None:  # a step that bypassed the pre-hook
            self.begin_step()
        self.step += 1
        self.since_sync += 1
        if self.since_sync < self.H:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Average the model over the group now and start a new round."""
        tensors = sync_tensors(
            self.optimizer, self.model, self.config.average_buffers, self.config.average_optimizer_state
        )
        average_(self.comm, tensors, tag="sync")
        self.since_sync = 0
        self.H = None
        self.syncs += 1
        self.sync_steps.append(self.step)
        if self.config.check_every and self.syncs % self.config.check_every == 0:
            named = self._named + [(f"buffer{i}", b) for i, b in enumerate(float_buffers(self.model))]
            verify_identical(self.comm, named, f"after QSR sync {self.syncs} (step {self.step})")

    def remove(self) -> None:
        """Unregister the optimizer hooks (the DDP comm hook stays until DDP is rebuilt)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ---- checkpointing -------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "since_sync": self.since_sync,
            "H": self.H,
            "syncs": self.syncs,
            "skipped_steps": self.skipped_steps,
            "config": {k: getattr(self.config, k) for k in self.config.__dataclass_fields__},
        }

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.since_sync = int(state["since_sync"])
        self.H = None if state["H"] is None else int(state["H"])
        self.syncs = int(state.get("syncs", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def __repr__(self) -> str:
        return f"QSRState(step={self.step}, since_sync={self.since_sync}, H={self.H}, syncs={self.syncs})"

