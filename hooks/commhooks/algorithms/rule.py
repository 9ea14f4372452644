"""The Quadratic Synchronisation Rule, and the config fields of every algorithm that syncs by it.

Gu, Lyu, Arora, Zhang, Huang, "A Quadratic Synchronization Rule for
Distributed Deep Learning", ICLR 2024 (arXiv 2310.14423)::

    H = max(h_base, floor((alpha / lr) ** power))

``power=2`` is QSR; 1 and 3 are the paper's comparison rules; ``alpha=0``
gives a constant period ``h_base``.  As the lr decays, H grows
quadratically, so communication thins out exactly when it matters least.

QSR (local SGD) and AB x QSR (AB phases sized by the rule) both use
:func:`rule_period` and declare their rule keys by deriving their config from
:class:`QuadraticRuleFields`; ``h_base`` is the one whose default each sets.
"""

from __future__ import annotations

import math
from typing import ClassVar, Dict, Optional

from pydantic import Field
from typing_extensions import Annotated

from ..settings import HookConfig

NEVER = 2**62  # a period that never ends (lr 0 and no total_steps)


class QuadraticRuleFields(HookConfig):
    """The rule's keys, declared once for every algorithm that syncs by it (a config base class)."""

    # keys that follow the lr schedule: an engine that knows the schedule (DeepSpeed's scheduler section)
    # fills them when the hook section leaves them unset; "total" = steps of the run, "warmup" = lr warm-up
    schedule_keys: ClassVar[Dict[str, str]] = {"total_steps": "total"}

    alpha: Annotated[float, Field(ge=0.0, description=(
        "rule growth: H = max(h_base, floor((alpha/lr)^power)); 0 = constant period h_base. Start from "
        "peak_lr * sqrt(h_base) and raise it to thin communication"))] = 0.0
    h_base: Annotated[Optional[int], Field(ge=1, description=(
        "shortest period between syncs, used at peak lr (null = the algorithm's default)"))] = None
    power: Annotated[float, Field(gt=0.0, description="2 = QSR; 1 and 3 are the paper's comparison rules")] = 2.0
    total_steps: Annotated[Optional[int], Field(ge=1, description=(
        "total optimizer steps of the run, if known: no period runs past the end, so the run ends synced"))] = None


def quadratic_rule(lr: float, alpha: float, h_base: int, power: float = 2.0) -> float:
    """``max(h_base, floor((alpha / lr) ** power))``; ``alpha = 0`` gives ``h_base``, ``lr <= 0`` infinity."""
    if alpha == 0.0:
        return h_base
    if lr <= 0.0:
        return math.inf  # a zero lr makes local steps free of drift
    ratio = (alpha / lr) ** power
    return max(h_base, math.floor(ratio) if math.isfinite(ratio) else math.inf)


def rule_period(step: int, lr: float, fields: QuadraticRuleFields, h_base: int, shorten_by: int = 0,
                floor: int = 1) -> int:
    """The rule's period for a round starting at ``step`` with ``lr``, less ``shorten_by``, capped at
    ``total_steps - step``, at least ``floor``."""
    h = quadratic_rule(lr, fields.alpha, h_base, fields.power) - shorten_by
    if fields.total_steps is not None:
        h = min(h, fields.total_steps - step)
    return max(floor, int(min(h, NEVER)))
