"""The faults ``commhooks faults`` injects, and when: a seeded Poisson process of job time, or an exact list."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional

KINDS = ("kill", "kill-node", "stall", "link-down", "throttle")
LINK_KINDS = ("link-down", "throttle")


@dataclass
class Fault:
    at_s: float  # job wall time, seconds
    kind: str
    target: int  # a rank (kill, stall) or a node (kill-node, link-down, throttle)
    duration_s: float = 0.0
    at_step: Optional[int] = None  # instead of at_s: once rank 0 reports this step (``--at @400:kill:1``)
    attempt: Optional[int] = None  # the attempt it hit (filled in when injected)
    step: Optional[int] = None  # rank 0's step when injected (sampled: the progress file is written each 0.05 s)


def schedule(kinds: List[str], mtbf_s: float, horizon_s: float, seed: int, ranks: int, nodes: int,
             stall_s: float, down_s: float) -> List[Fault]:
    """Faults at exponential gaps of mean ``mtbf_s`` up to ``horizon_s``, kind and target drawn from ``seed``."""
    rng, t, faults = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return faults
        kind = rng.choice(kinds)
        target = rng.randrange(nodes if kind in ("kill-node",) + LINK_KINDS else ranks)
        faults.append(Fault(round(t, 2), kind, target, stall_s if kind == "stall" else
                            down_s if kind in LINK_KINDS else 0.0))


def parse_at(text: str) -> List[Fault]:
    """``--at 8:link-down:1:12,@400:kill:2``: time (s) or ``@step`` (rank 0's), kind, target[, duration (s)]."""
    faults = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        try:
            if len(parts) not in (3, 4) or parts[1] not in KINDS:
                raise ValueError
            at_step = int(parts[0][1:]) if parts[0].startswith("@") else None
            faults.append(Fault(0.0 if at_step is not None else float(parts[0]), parts[1], int(parts[2]),
                                float(parts[3]) if len(parts) == 4 else 0.0, at_step=at_step))
        except ValueError:
            raise ValueError(f"--at {item!r}: expected time:kind:target[:duration] (time in seconds, or @step) "
                             f"with kind one of {KINDS}") from None
    return faults
