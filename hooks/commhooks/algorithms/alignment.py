"""Keeping every rank on the same schedule: skipped AMP steps, a step proof in each sync, Join shadowing.

Local methods issue collectives at points each rank computes for itself (a
sync every H steps, a phase switch).  Anything that makes one rank take a
different number of optimizer steps pairs the wrong collectives.  Three
mechanisms keep the schedule a function of the iteration on every rank:

* **GradScaler**: ``scaler.step(optimizer)`` skips ``optimizer.step()`` on a
  rank whose gradients overflowed, so its step hooks would not see that
  iteration.  The state marks the optimizer ``_step_supports_amp_scaling``
  (torch's documented protocol for optimizers that handle scaling
  themselves): the scaler then always calls ``step()`` and hands over
  ``grad_scale`` and ``found_inf``; the state's pre-hook unscales the
  gradients, or drops them when ``found_inf`` (the optimizer then updates
  nothing, as the scaler would have), and the step counts on every rank.
  Optimizers that already support it (``fused=True``) are left alone.
* **Step proof**: every sync carries the step counter in its payload (a few
  more elements of the same flat allreduce, no extra collective); a mismatch
  raises :class:`DivergenceError` on every rank, naming the steps.
* **Scales that part**: a rank that overflows in a local step halves its
  GradScaler scale alone; the next gradient-averaging step (AB's full-rank
  steps, QSR's replica groups) would then average gradients scaled by
  different factors.  Each sync carries log2 of the rank's scale; when they
  differ, a state given the scaler (``state.use_scaler(scaler)``, or
  ``commhooks.ddp.register(..., scaler=scaler)``) sets every rank's scale to
  the smallest one, otherwise it warns once.
* **Join**: the state is a ``torch.distributed.algorithms.join`` joinable
  (duck-typed: ``join_hook``, ``join_device``, ``join_process_group``).  In
  ``with Join([ddp_model, state]):`` a rank that ran out of data shadows each
  remaining iteration of the others: it counts the step, takes part in the
  syncs and phase switches, and agrees on lr-dependent periods (the max over
  ranks, to which a joined rank contributes 0).
"""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional, Sequence

import torch

from ..comm import CollectiveError
from .consistency import DivergenceError

# the step is proved in base 64: three limbs (steps below 262,144 compared exactly, beyond that modulo it)
# and their squares, plus the step itself (only for the message); then log2 of the GradScaler scale the rank
# last used (0 without one) and its square; then 1 if the rank saw a NaN/Inf gradient since (the nonfinite
# guard's record, read here at the sync rather than on every step); all exact in float32 sums
_LIMBS = 3
_SCALE = 2 * _LIMBS + 1  # index of log2(scale); its square follows
_NONFINITE = _SCALE + 2
PROOF_ELEMENTS = _NONFINITE + 1
STEP_PROOF_BYTES = 4 * PROOF_ELEMENTS  # added to the payload of every sync

LIKELY_CAUSES = (
    "likely causes: a rank called optimizer.step() a different number of times (an extra or a missing step, "
    "a second optimizer stepped on one rank only), uneven inputs without "
    "`with torch.distributed.algorithms.join.Join([ddp_model, state])`, or a GradScaler-like wrapper that "
    "skips optimizer.step() on some ranks (torch.amp.GradScaler itself is handled)"
)


def step_proof(step: int, scale=None, nonfinite: Optional[torch.Tensor] = None,
               device: Optional[torch.device] = None) -> torch.Tensor:
    """The elements a rank adds to its sync payload to prove it is at ``step`` (and to show its AMP scale and
    whether it saw a NaN/Inf gradient), made on ``device``.  ``scale``: a float or a one-element tensor (read on
    the device, no host stall); ``nonfinite``: a one-element float32 tensor, 1 or 0."""
    device = torch.device("cpu") if device is None else device
    limbs = [(step >> (6 * i)) & 63 for i in range(_LIMBS)]
    counters = torch.tensor(limbs + [x * x for x in limbs] + [float(step)], dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        log_scale = torch.round(torch.log2(scale.detach().reshape(1).to(device=device, dtype=torch.float32)))
    else:
        value = float(round(math.log2(scale))) if scale else 0.0
        log_scale = torch.full((1,), value, dtype=torch.float32, device=device)
    flag = torch.zeros(1, dtype=torch.float32, device=device) if nonfinite is None else nonfinite.to(device)
    return torch.cat([counters, log_scale, log_scale * log_scale, flag.reshape(1)])


def proof_sums(mean: torch.Tensor, size: int) -> List[float]:
    """The ranks' proofs summed (``mean * size``, rounded: every element is an integer), read to the host once."""
    return torch.round(mean.double() * size).tolist()


def scales_differ(sums: Sequence[float], size: int) -> bool:
    """After the sync (``sums``: :func:`proof_sums`): did the ranks' GradScaler scales (log2) differ?"""
    if size == 1:
        return False
    s1, s2 = sums[_SCALE], sums[_SCALE + 1]
    return size * s2 != s1 * s1


def nonfinite_ranks(sums: Sequence[float]) -> int:
    """After the sync (``sums``: :func:`proof_sums`): how many ranks saw a NaN/Inf gradient since their last sync."""
    return int(sums[_NONFINITE])


def check_step_proof(sums: Sequence[float], step: int, size: int, rank: int, what: str) -> None:
    """Raise DivergenceError (on every rank alike) if the averaged proof shows different steps.

    The ranks' limbs x_i agree iff ``n * sum(x_i^2) == (sum x_i)^2``; every rank
    sees the same sums, so every rank reaches the same verdict.
    """
    if size == 1:
        return
    first, squares = sums[:_LIMBS], sums[_LIMBS:2 * _LIMBS]
    if all(size * q == f * f for f, q in zip(first, squares)):
        return
    total = sums[2 * _LIMBS]
    others = f"the other rank is at step {int(round(total - step))}" if size == 2 else (
        f"the {size} ranks' steps add up to {int(round(total))} (mean {total / size:.2f})")
    raise DivergenceError(
        f"{what}: the ranks are at different optimizer steps: this rank ({rank}) is at step {step}, {others}; "
        f"{LIKELY_CAUSES}"
    )


# ------------------------------------------------------------------ GradScaler


def take_over_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Make ``GradScaler.step`` always call ``optimizer.step()`` (the state unscales / skips); True if done."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        return False  # a fused optimizer handles grad_scale / found_inf itself
    optimizer._step_supports_amp_scaling = True
    return True


def release_amp_scaling(optimizer: torch.optim.Optimizer) -> None:
    optimizer.__dict__.pop("_step_supports_amp_scaling", None)


def scaler_inputs(optimizer: torch.optim.Optimizer):
    """``(grad_scale, found_inf)`` a GradScaler handed to this step, or ``(None, None)`` outside one."""
    return getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)


@torch.no_grad()
def apply_scaler(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 grad_scale: Optional[torch.Tensor], found_inf: torch.Tensor) -> bool:
    """Do what ``GradScaler`` would have: drop the gradients on overflow (True), else unscale them.

    One host read (``found_inf``), the one torch's own ``GradScaler.step`` makes for a non-fused optimizer:
    whether to step at all must be known on the host.  The scaler's two attributes are then set to None:
    the optimizer's own step must not apply them again (torch's non-fused optimizers refuse them), and the
    scaler still finds them to delete.
    """
    optimizer.grad_scale = None
    optimizer.found_inf = None
    if bool(found_inf.item()):
        for p in params:
            p.grad = None  # torch's optimizers then leave p, its momentum and its weight decay alone
        return True
    if grad_scale is not None:
        grads: List[torch.Tensor] = [p.grad for p in params if p.grad is not None]
        by_device: dict = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        inv = grad_scale.double().reciprocal().float()
        for (device, _), same in by_device.items():
            torch._foreach_mul_(same, inv.to(device))
    return False


# ------------------------------------------------------------------ Join


class ShadowJoinHook:
    """What a joined rank runs for each iteration the others still train (torch's ``JoinHook`` interface)."""

    def __init__(self, state):
        self.state = state

    def main_hook(self) -> None:
        self.state.alignment.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.state.join_ended_by_engine:  # the engine's hook ended it first (DDP: before its broadcast)
            self.state.join_ended_by_engine = False
            return
        self.state.alignment.end_join()


_COLLECTIVE_HINT = ("if a peer has finished its data (uneven inputs), wrap the loop in "
                    "`with torch.distributed.algorithms.join.Join([ddp_model, state]):`; if a peer died or is stuck, "
                    "its own log says why")


@contextlib.contextmanager
def named_failures(step: int):
    """A failed or timed-out collective inside names the optimizer step and the usual causes (the message already
    holds the backend's)."""
    try:
        yield
    except CollectiveError as exc:
        raise CollectiveError(f"{exc} [at optimizer step {step}; {_COLLECTIVE_HINT}]") from None

