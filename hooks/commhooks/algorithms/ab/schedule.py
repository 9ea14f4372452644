"""The AB phase schedule on the absolute optimizer step t.

With warm-up ``W``, period ``P`` and ``F`` full-rank steps::

    t <  W            warm-up: full-rank gradient allreduce over the world
    t == W            enter AB (basis from the current weights)
    t % P == 0        (in AB) sync over the world, then F full-rank steps
    t % P == F        (at full rank) truncated re-basis, re-enter AB

With ``F == 0`` the sync and the re-basis happen before the same step. Transitions run between optimizer steps, so
the step they precede already uses the new phase.

``sync_rule="qsr"`` (AB x QSR): the first AB phase ends as above (at the first multiple of P after the warm-up);
every later AB phase lasts ``H - F`` steps, with H from the quadratic rule and the lr of the phase's first step, at
least 1 and capped at ``total_steps``; the F full-rank steps follow each sync.  With ``alpha = 0`` (H = h_base = P)
this is the plain schedule.

Under either rule, an AB phase open at ``total_steps`` (when it is known) syncs there: the run ends with identical
weights on every rank, whatever the period.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, List, Optional

from ..qsr.state import rule_period
from .config import ABConfig

WARMUP, AB, FULL = "warmup", "ab", "full"
SYNC, ENTER = "sync", "enter"


@dataclasses.dataclass
class Clock:
    """Where the schedule stands: the phase, when it began, and (qsr rule) when the AB phase ends."""

    phase: str = WARMUP
    entered_at: int = -1  # step of the latest AB entry
    synced_at: int = -1  # step before which the latest sync ran
    phase_end: Optional[int] = None  # qsr rule: step before which the current AB phase syncs
    entries: int = 0


    def events(self, t: int, config: ABConfig) -> List[str]:
        """What must happen before step ``t``."""
        p, f = config.sync_period, config.full_rank_steps
        qsr = config.sync_rule == "qsr"
        if self.phase == WARMUP:
            return [ENTER] if t >= config.warmup_steps else []
        if self.phase == AB:
            if qsr and self.entries > 1:
                done = self.phase_end is not None and t >= self.phase_end
            else:
                done = t % p == 0 and t > self.entered_at
            if config.total_steps is not None and t == config.total_steps and t > self.entered_at:
                return [SYNC]  # the run's end: synced, no new phase after it
            return ([SYNC, ENTER] if f == 0 else [SYNC]) if done else []
        return [ENTER] if (t == self.synced_at + f if qsr else t % p == f) else []

    def apply(self, event: str, t: int) -> None:
        """Move past ``event``, run before step ``t``."""
        if event == SYNC:
            self.phase, self.synced_at, self.phase_end = FULL, t, None
        else:
            self.phase, self.entered_at, self.phase_end = AB, t, None
            self.entries += 1

    def advance(self, t: int, config: ABConfig) -> Iterator[str]:
        """The transitions due before step ``t``, each applied once its caller has run it (the state, the traffic
        declaration and :func:`phases` walk the schedule through this one loop)."""
        for event in self.events(t, config):
            yield event
            self.apply(event, t)

    def size(self, t: int, lr: Callable[[], float], config: ABConfig, agree=None) -> None:
        """Under the qsr rule, an AB phase that has just begun (after the first) lasts ``H - F`` steps from ``t``,
        H by the rule at ``lr()`` (read only then; ``agree``: the ranks' max of it), capped, at least 1."""
        if config.sync_rule == "qsr" and self.phase == AB and self.entries > 1 and self.phase_end is None:
            length = rule_period(t, lr(), config, config.period_base, shorten_by=config.full_rank_steps)
            self.phase_end = t + (length if agree is None else agree(length))


def phases(total_steps: int, config: ABConfig, lr_at: Optional[Callable[[int], float]] = None) -> List[str]:
    """The phase of each step ``0 .. total_steps-1`` (for plots, tests and the LR rebound).

    ``lr_at(t)`` gives the lr of step t; needed with ``sync_rule="qsr"``.
    """
    def lr(t: int) -> float:
        if lr_at is None:
            raise ValueError("phases() needs lr_at for sync_rule 'qsr'")
        return lr_at(t)

    out, clock = [], Clock()
    for t in range(total_steps):
        for _ in clock.advance(t, config):
            pass
        clock.size(t, lambda: lr(t), config)
        out.append(clock.phase)
    return out
