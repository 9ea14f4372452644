"""GradScaler under local methods: every rank counts every step, and scales that part are made equal again.

``scaler.step(optimizer)`` skips ``optimizer.step()`` on a rank whose gradients overflowed, so that rank's step
hooks would not see the iteration and its schedule would fall behind.  :class:`AmpScaling` marks the optimizer
``_step_supports_amp_scaling`` (torch's documented protocol for optimizers that handle scaling themselves): the
scaler then always calls ``step()`` and hands over ``grad_scale`` and ``found_inf``; the state's pre-hook unscales
the gradients, or drops them when ``found_inf`` (the optimizer then updates nothing, as the scaler would have), and
the step counts on every rank.  Optimizers that already support it (``fused=True``) are left alone.

A rank that overflows in a local step halves its scale alone; the next gradient-averaging steps (AB's full-rank
steps, QSR's replica groups) would then average gradients scaled by different factors.  Each sync's step proof
carries log2 of the scale the rank will hold after the step's ``scaler.update()`` (an overflow in the sync step
itself halves it only then, just before AB's full-rank steps); when they differ, a state given the scaler
(``state.use_scaler(scaler)``, or ``commhooks.ddp.register(..., scaler=scaler)``) makes every rank end the update
with the smallest scale and the same growth count, otherwise it warns at each sync that finds them apart.
"""

from __future__ import annotations

import warnings
from typing import List, Optional

import torch

from .parameters import user_stacklevel


class AmpScaling:
    """One state's GradScaler handling.  ``name``: the state's, for messages; ``averages_gradients()``: whether
    parted scales would mix in a gradient mean (then the warning, without the scaler)."""

    def __init__(self, name: str, averages_gradients):
        self.name, self.averages_gradients = name, averages_gradients
        self.scaler = None  # the torch.amp.GradScaler whose scale the syncs keep equal (state.use_scaler)
        self.last_scale: Optional[torch.Tensor] = None  # the scale handed to the last step (on the device)
        self.owned: List[torch.optim.Optimizer] = []
        self.overflowed = False  # this step's gradients overflowed here: the scaler backs off after the step

    def take_over(self, optimizers) -> None:
        """GradScaler then always calls these optimizers' ``step()``, and the state unscales or drops."""
        for opt in optimizers:
            if not getattr(opt, "_step_supports_amp_scaling", False):  # a fused optimizer handles it itself
                opt._step_supports_amp_scaling = True  # torch's protocol attribute, read by GradScaler.step
                self.owned.append(opt)

    def release(self) -> None:
        for opt in self.owned:
            opt.__dict__.pop("_step_supports_amp_scaling", None)
        self.owned = []

    @torch.no_grad()
    def step(self, optimizer, params) -> tuple:
        """What a GradScaler handed this step: ``(dropped, checked)``.  On an overflow the gradients are dropped
        (one host read of ``found_inf``, the one torch's own ``GradScaler.step`` makes), otherwise unscaled;
        the scaler's two attributes are set to None so the optimizer's own step does not apply them again."""
        grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
        self.overflowed = False
        if grad_scale is not None:
            self.last_scale = grad_scale.detach()  # a fresh tensor each step (scale * 1): no copy, no host read
        if found_inf is None:
            return False, False
        if not any(optimizer is o for o in self.owned):
            return False, True
        optimizer.grad_scale = optimizer.found_inf = None
        if bool(found_inf.item()):
            for p in params:
                p.grad = None  # torch's optimizers then leave p, its momentum and its weight decay alone
            self.overflowed = True
            return True, True
        if grad_scale is not None:
            by_device: dict = {}
            for p in params:
                if p.grad is not None:
                    by_device.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            inv = grad_scale.double().reciprocal().float()
            for (device, _), same in by_device.items():
                torch._foreach_mul_(same, inv.to(device))
        return False, True

    def equalize(self, comm, group, step: int) -> None:
        """Every rank of ``group`` ends this step's ``update()`` with the same scale and growth count: the smallest
        scale, backed off everywhere if any rank overflowed in this step (or, without the scaler, a warning at
        each sync that finds them apart: ``step`` names it)."""
        if self.scaler is None:
            if self.averages_gradients():
                warnings.warn(
                    f"{self.name}: at the sync after optimizer step {step} the ranks' GradScaler scales differ (a rank "
                    "overflowed during local steps); the next gradient-averaging steps average gradients scaled by "
                    "different factors and the ranks part. Pass the scaler: state.use_scaler(scaler) or "
                    "commhooks.ddp.register(..., scaler=scaler)", stacklevel=user_stacklevel())
            return
        scale = self.scaler._scale  # GradScaler keeps it as a one-element tensor (torch's own field)
        seen = torch.tensor([0.0, float(self.overflowed)], dtype=torch.float64, device=comm.device)
        seen[0] = -scale.detach().double().reshape(())
        comm.allreduce([seen], op="max", group=group, tag="amp-scale", metered=False)
        lowest, anyone = (-seen[0]).item(), bool(seen[1].item())
        if anyone and not self.overflowed:  # update() backs off only where the step overflowed: do it here now,
            lowest *= self.scaler.get_backoff_factor()  # and count growth from -1 so that update() leaves it at 0
        scale.fill_(lowest)
        self.scaler._growth_tracker.fill_(-1 if anyone and not self.overflowed else 0)  # restart growth alike
