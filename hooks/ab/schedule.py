"""The AB phase schedule on the absolute optimizer step t.

With warm-up ``W``, period ``P`` and ``F`` full-rank steps::

    t <  W            warm-up: full-rank gradient allreduce over the world
    t == W            enter AB (basis from the current weights)
    t % P == 0        (in AB) sync over the world, then F full-rank steps
    t % P == F        (at full rank) truncated re-basis, re-enter AB

With ``F == 0`` the sync and the re-basis happen before the same step.
Transitions run between optimizer steps, so the step they precede already
uses the new phase.
"""

from __future__ import annotations

from typing import List

from ..config import ABConfig

WARMUP, AB, FULL = "warmup", "ab", "full"
SYNC, ENTER = "sync", "enter"


def events_before(t: int, phase: str, entered_at: int, config: ABConfig) -> List[str]:
    """What must happen before step ``t``, given the current phase and when AB was entered."""
    p, f = config.sync_period, config.full_rank_steps
    if phase == WARMUP:
        return [ENTER] if t >= config.warmup_steps else []
    if phase == AB:
        if t % p == 0 and t > entered_at:
            return [SYNC, ENTER] if f == 0 else [SYNC]
        return []
    return [ENTER] if t % p == f else []


def next_phase(event: str) -> str:
    """A sync leaves AB for full rank; an entry (re-basis) starts AB."""
    return AB if event == ENTER else FULL


def phases(total_steps: int, config: ABConfig) -> List[str]:
    """The phase of each step ``0 .. total_steps-1`` (for plots, tests and the LR rebound)."""
    out, phase, entered = [], WARMUP, -1
    for t in range(total_steps):
        for ev in events_before(t, phase, entered, config):
            phase = next_phase(ev)
            if ev == ENTER:
                entered = t
        out.append(phase)
    return out
