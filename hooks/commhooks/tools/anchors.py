"""The methods commhooks is measured against: PyTorch's own DDP hooks, registered as their docs show.

* ``fp16``: ``default_hooks.fp16_compress_hook`` (half the bytes of an allreduce).
* ``powersgd``: ``powerSGD_hook`` with ``PowerSGDState(matrix_approximation_rank=r)``,
  plain allreduce for the first ``start_iter`` steps (torch's default of 1000 would
  cover most of a short run).
* ``local-sgd``: ``post_localSGD_hook`` (gradient allreduce for ``start_iter`` steps,
  then none) and ``PeriodicModelAverager(period)`` after every optimizer step.
* ``compute-only``: no communication at all, the lower bound on time per step.
"""

from __future__ import annotations

ANCHORS = ("fp16", "powersgd", "local-sgd", "compute-only")


def keep_local_hook(state, bucket):
    """A DDP hook that keeps each rank's own gradients (no communication at all)."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def register_anchor(method: str, ddp_model, optimizer, powersgd_rank: int = 4, local_period: int = 8, start_iter: int = 50):
    """Register ``method`` on ``ddp_model``; returns its state (no commhooks meter)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    if method == "fp16":
        ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if method == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=max(2, start_iter))
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    if method == "local-sgd":
        state = post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=start_iter,
                                                     post_local_gradient_allreduce=False)
        ddp_model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        averager = PeriodicModelAverager(period=local_period, warmup_steps=start_iter)
        optimizer.register_step_post_hook(lambda opt, args, kwargs: averager.average_parameters(ddp_model.parameters()))
        return state
    if method == "compute-only":
        ddp_model.register_comm_hook(None, keep_local_hook)  # nothing is ever synced
        return None
    raise ValueError(f"unknown anchor method {method!r}; choose from {ANCHORS}")
