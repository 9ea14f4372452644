"""PyTorch DDP adapter: one comm hook for ``DistributedDataParallel.register_comm_hook``, any algorithm.

Thin by design: DDP hands a :class:`torch.distributed.GradBucket` to the hook;
if the algorithm's state declares ``reduces_gradients``, the hook asks it to
reduce the bucket and returns a future of the bucket's new contents,
otherwise it returns the local bucket untouched (local steps: nothing is
sent).  Step counting and syncs happen in the optimizer step hooks that
every state registers.

Usage, one line after building the DDP model and optimizer, with a config
object, dict or JSON file from ``configs/``::

    state = commhooks.ddp.register(ddp_model, optimizer, "configs/qsr_mnist1d.json")

or by hand::

    state = commhooks.QSRState(optimizer, model=ddp_model, alpha=0.0175, h_base=4)
    ddp_model.register_comm_hook(state, commhooks.ddp.comm_hook)

Build DDP with ``forward_sync_buffers=False`` (torch >= 2.13; older:
``broadcast_buffers=False``) for local methods: otherwise DDP re-broadcasts
rank 0's buffers on every forward.
"""

from typing import Optional

import torch
import torch.distributed as dist

from . import comm as comms
from . import facts, registry
from .comm import Comm
from .config import ConfigError, load_config


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def comm_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook of every commhooks algorithm.

    A state with ``reduces_gradients`` reduces the bucket (its gradients are
    written in place, so ``gradient_as_bucket_view=True`` works; state is
    keyed by parameter, so DDP's bucket rebuild after the first iteration is
    harmless).  Any other state keeps the local gradients: no byte crosses
    the network in backward, and DDP leaves the bucket unscaled.
    """
    buffer = bucket.buffer()
    if not state.reduces_gradients:
        return _completed(buffer)
    work = state.reduce_bucket(bucket.gradients(), bucket.parameters(), flat=buffer)
    return _landed(work, buffer)


def _landed(work, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """The bucket's future: ``buffer`` once ``work`` is done, or its error, raised in DDP's backward (a failed
    reduction never hands back the local gradient as if it were the mean)."""

    def landed(fut):
        fut.value()
        return buffer

    return work.future().then(landed)


class AllreduceState:
    """State of :func:`allreduce_hook`: a :class:`Comm` whose meter counts DDP's gradient traffic."""

    def __init__(self, process_group=None, comm: Optional[Comm] = None):
        if comm is None:
            comm = comms.TorchComm(process_group)
        self.comm = comm

    @property
    def meter(self):
        return self.comm.meter

    # every rank holds the same model after each step: the run's end needs nothing (the same calls as the
    # algorithms' states, so a loop written for them runs with {"type": "none"} unchanged)
    def __enter__(self) -> "AllreduceState":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        return False

    def finish(self) -> None:
        """Nothing to land: DDP's allreduce leaves every rank with the same model."""


def allreduce_hook(state: AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default gradient averaging, through :class:`Comm` so the bytes are metered.

    Numerically the same as registering no hook; the baseline every method is measured against.
    """
    buffer = bucket.buffer()
    return _landed(state.comm.allreduce([buffer], op="mean", async_op=True, tag="grad"), buffer)


def _check_ddp(ddp_model) -> None:
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise ConfigError(
            f"commhooks.ddp.register needs the DistributedDataParallel model, got {type(ddp_model).__name__}: frameworks "
            "keep it apart from your module (Accelerate: what accelerator.prepare(model) returned; Hugging Face "
            "Trainer: trainer.model_wrapped, or use commhooks.integrations.transformers.CommHookCallback; Lightning: "
            "trainer.strategy.model, or use commhooks.integrations.lightning.CommHookCallback)")


def register(ddp_model, optimizer, config, process_group=None, scaler=None, **state_options):
    """Build the state for ``config`` and register its hook on ``ddp_model``; return the state.

    ``config`` is a config object, a dict or a JSON path naming any
    registered algorithm; ``{"type": "none"}`` registers the metered plain
    allreduce.  ``optimizer``: one or a list, as frameworks hand them out
    (Accelerate's and Lightning's wrappers are unwrapped).  ``scaler``: your
    ``torch.amp.GradScaler``, if any, so the syncs keep its scale equal on
    every rank (see ``state.use_scaler``).  ``state_options``: what the
    algorithm's state takes besides its config, passed on unchanged (QSR's
    ``outer_optimizer=lambda ps: torch.optim.SGD(ps, ...)``; a JSON config
    names no optimizer).  Afterwards ``with ddp_model.join():`` includes the
    state.
    """
    _check_ddp(ddp_model)
    config = load_config(config)
    if config is None:
        if state_options:
            raise ConfigError(f"commhooks.ddp.register: {{'type': 'none'}} takes no {', '.join(map(repr, state_options))}")
        state = AllreduceState(process_group)
        ddp_model.register_comm_hook(state, allreduce_hook)
        return state
    algorithm = registry.for_config(config)
    algorithm.check_options(state_options, "commhooks.ddp.register")
    state = algorithm.state_class(optimizer=optimizer, model=ddp_model, engine=facts.for_model(ddp_model),
                                  process_group=process_group, config=config, **state_options)
    if scaler is not None:
        state.use_scaler(scaler)
    ddp_model.register_comm_hook(state, comm_hook)  # `with ddp_model.join():` includes the state (its facts' attach)
    return state
