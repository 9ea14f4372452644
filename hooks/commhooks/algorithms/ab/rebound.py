"""LR rebound: after each AB phase switch, restart the lr low and ramp it back.

Each phase switch restarts the optimizer state of the weights involved (see :mod:`commhooks.ab.state`); a fresh Adam
or momentum buffer at full lr makes a large first step.  The paper drops the lr to 1e-5 at every switch and ramps it
linearly back to the scheduled value over ``rebound_steps`` (267 steps for VGG16, about a third of the sync period).
"""

from __future__ import annotations

from typing import List, Optional


class LRRebound:
    """Wrap your lr scheduler; call its ``step()`` as usual.

        scheduler = commhooks.ab.LRRebound(torch.optim.lr_scheduler.CosineAnnealingLR(opt, T), state)

    The wrapped scheduler keeps computing the schedule as if nothing happened (its chainable formulas see their
    own lr, restored before each of its steps); the optimizer gets ``floor_lr + (lr - floor_lr) * j /
    rebound_steps`` at the j-th step after a switch.
    """

    def __init__(self, scheduler, state, rebound_steps: Optional[int] = None, floor_lr: float = 1e-5):
        self.scheduler = scheduler
        self.state = state
        self.optimizer = scheduler.optimizer
        self.rebound_steps = state.config.rebound_steps if rebound_steps is None else int(rebound_steps)
        if self.rebound_steps < 0:
            raise ValueError(f"rebound_steps must be >= 0, got {self.rebound_steps}")
        self.floor_lr = floor_lr
        self._scheduled: List[float] = [g["lr"] for g in self.optimizer.param_groups]
        self._apply()

    def factor(self) -> float:
        """Fraction of the way back to the scheduled lr, for the next optimizer step."""
        if self.rebound_steps == 0 or self.state.last_switch is None:
            return 1.0
        return min(1.0, (self.state.step - self.state.last_switch) / self.rebound_steps)

    def _apply(self) -> None:
        """Set each group's ramped ``lr``; ``scheduled_lr`` keeps the schedule's value, which a sync rule
        reads (:meth:`AlgorithmState.lr`) so the ramp does not stretch the period."""
        f = self.factor()
        for group, lr in zip(self.optimizer.param_groups, self._scheduled):
            group["scheduled_lr"] = lr
            group["lr"] = lr if f >= 1.0 else self.floor_lr + (lr - self.floor_lr) * f

    def step(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self._scheduled):
            group["lr"] = lr  # the wrapped scheduler continues from its own value
        self.scheduler.step()
        self._scheduled = [g["lr"] for g in self.optimizer.param_groups]
        self._apply()

    def get_last_lr(self) -> List[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "scheduled": list(self._scheduled)}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self._scheduled = list(state["scheduled"])
        self._apply()
