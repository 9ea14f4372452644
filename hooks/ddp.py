"""PyTorch DDP adapter: comm hooks for ``DistributedDataParallel.register_comm_hook``.

Thin by design: DDP hands a :class:`torch.distributed.GradBucket` to the hook,
the hook asks the algorithm's state what to do with it, and returns a future
of the bucket's new contents.  Step counting and syncs happen in optimizer
step hooks that the states register themselves.

Usage, two lines after building the DDP model and optimizer::

    state = commhooks.QSRState(optimizer, model=ddp_model, alpha=0.0175, h_base=4)
    ddp_model.register_comm_hook(state, commhooks.qsr_hook)

or in one call, with a config object, dict or JSON file from ``configs/``::

    state = commhooks.ddp.register(ddp_model, optimizer, "configs/qsr_mnist1d.json")

AB-training the same way::

    state = commhooks.ABState(ddp_model, optimizer, warmup_steps=300, sync_period=100, full_rank_steps=10)
    ddp_model.register_comm_hook(state, commhooks.ab_hook)
"""


from typing import Optional

import torch
import torch.distributed as dist

from .ab import ABState
from .comm import Comm
from .config import load_config
from .qsr import QSRState


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def qsr_hook(state: QSRState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Local SGD: keep the local gradients; parameters are averaged by the state's step hook.

    No byte crosses the network in backward.  DDP leaves the bucket
    unscaled, so each rank's optimizer sees exactly its own gradient.
    """
    return _completed(bucket.buffer())


def ab_hook(state: ABState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """AB-training: full-rank allreduce in warm-up and full-rank phases; in AB phases only the
    factor gradient (G B^T on A-ranks, A^T G on B-ranks) is averaged, inside the rank's group.

    State is keyed by parameter, so DDP's bucket rebuild after the first iteration is harmless;
    works with ``gradient_as_bucket_view=True`` (the bucket's gradients are written in place).
    """
    buffer = bucket.buffer()
    work = state.reduce_gradients(bucket.gradients(), bucket.parameters(), flat=buffer)
    return work.future().then(lambda fut: buffer)


class AllreduceState:
    """State of :func:`allreduce_hook`: a :class:`Comm` whose meter counts DDP's gradient traffic."""

    def __init__(self, process_group=None, comm: Optional[Comm] = None):
        if comm is None:
            from .comm.torch_dist import TorchComm

            comm = TorchComm(process_group)
        self.comm = comm

    @property
    def meter(self):
        return self.comm.meter


def allreduce_hook(state: AllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default gradient averaging, through :class:`Comm` so the bytes are metered.

    Numerically the same as registering no hook; the baseline every method is measured against.
    """
    buffer = bucket.buffer()
    work = state.comm.allreduce([buffer], op="mean", async_op=True, tag="grad")
    return work.future().then(lambda fut: buffer)


def register(ddp_model, optimizer, config, process_group=None):
    """Build the state for ``config`` and register its hook on ``ddp_model``; return the state.

    ``config`` is a config object, a dict or a JSON path; ``{"type": "none"}``
    registers the metered plain allreduce.
    """
    config = load_config(config)
    if config is None:
        state = AllreduceState(process_group)
        ddp_model.register_comm_hook(state, allreduce_hook)
        return state
    if config.kind == "qsr":
        state = QSRState(optimizer, model=ddp_model, process_group=process_group, config=config)
        ddp_model.register_comm_hook(state, qsr_hook)
        return state
    state = ABState(ddp_model, optimizer, process_group=process_group, config=config)
    ddp_model.register_comm_hook(state, ab_hook)
    return state
