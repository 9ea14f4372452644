"""The AB phase schedule on the absolute optimizer step t.

With warm-up ``W``, period ``P`` and ``F`` full-rank steps::

    t <  W            warm-up: full-rank gradient allreduce over the world
    t == W            enter AB (basis from the current weights)
    t % P == 0        (in AB) sync over the world, then F full-rank steps
    t % P == F        (at full rank) truncated re-basis, re-enter AB

With ``F == 0`` the sync and the re-basis happen before the same step.
Transitions run between optimizer steps, so the step they precede already
uses the new phase.

``sync_rule="qsr"`` (AB x QSR): the first AB phase ends as above (at the
first multiple of P after the warm-up); every later AB phase lasts
``H - F`` steps, with H from the quadratic rule and the lr of the phase's
first step, at least 1 and capped at ``total_steps``; the F full-rank steps
follow each sync.  With ``alpha = 0`` (H = h_base = P) this is the plain
schedule.

Under either rule, an AB phase open at ``total_steps`` (when it is known) syncs
there: the run ends with identical weights on every rank, whatever the period.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

from ..rule import rule_period
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


def events_before(t: int, clock: Clock, config: ABConfig) -> List[str]:
    """What must happen before step ``t``."""
    p, f = config.sync_period, config.full_rank_steps
    qsr = config.sync_rule == "qsr"
    if clock.phase == WARMUP:
        return [ENTER] if t >= config.warmup_steps else []
    if clock.phase == AB:
        if qsr and clock.entries > 1:
            done = clock.phase_end is not None and t >= clock.phase_end
        else:
            done = t % p == 0 and t > clock.entered_at
        if config.total_steps is not None and t == config.total_steps and t > clock.entered_at:
            return [SYNC]  # the run's end: synced, no new phase after it
        return ([SYNC, ENTER] if f == 0 else [SYNC]) if done else []
    return [ENTER] if (t == clock.synced_at + f if qsr else t % p == f) else []


def apply(event: str, t: int, clock: Clock) -> None:
    """Advance the clock past ``event`` before step ``t``."""
    if event == SYNC:
        clock.phase, clock.synced_at, clock.phase_end = FULL, t, None
    else:
        clock.phase, clock.entered_at, clock.phase_end = AB, t, None
        clock.entries += 1


def ab_phase_length(t: int, lr: float, config: ABConfig) -> int:
    """Length of the AB phase starting at ``t`` under the qsr rule: ``H - F``, capped, at least 1."""
    return rule_period(t, lr, config, config.period_base, shorten_by=config.full_rank_steps)


def needs_length(clock: Clock, config: ABConfig) -> bool:
    """The qsr rule must still size the AB phase that has just begun."""
    return config.sync_rule == "qsr" and clock.phase == AB and clock.entries > 1 and clock.phase_end is None


def phases(total_steps: int, config: ABConfig, lr_at: Optional[Callable[[int], float]] = None) -> List[str]:
    """The phase of each step ``0 .. total_steps-1`` (for plots, tests and the LR rebound).

    ``lr_at(t)`` gives the lr of step t; needed with ``sync_rule="qsr"``.
    """
    out, clock = [], Clock()
    for t in range(total_steps):
        for event in events_before(t, clock, config):
            apply(event, t, clock)
        if needs_length(clock, config):
            if lr_at is None:
                raise ValueError("phases() needs lr_at for sync_rule 'qsr'")
            clock.phase_end = t + ab_phase_length(t, lr_at(t), config)
        out.append(clock.phase)
    return out
