"""AB-training's settings (the ``"ab"`` config type)."""

from __future__ import annotations

from typing import List, Literal, Optional

from pydantic import Field, model_validator
from typing_extensions import Annotated

from ...settings import ConfigError
from ...payload import PayloadFields
from ..qsr.config import QuadraticRuleFields


class ABConfig(QuadraticRuleFields, PayloadFields):
    """AB-training: low-rank factors trained by independent groups, averaged periodically.

    Coquelin et al., arXiv 2405.01067.  Defaults are the paper's VGG16 / CIFAR-10 settings (8 GPUs, batch 1024):
    scale ``warmup_steps``, ``sync_period``, ``full_rank_steps`` and ``rebound_steps`` with the length of your
    run (the paper: warm-up ~10 % of training, a sync about every 1.7 epochs, 8 % of each period at full rank).

    ``sync_rule="qsr"`` lets the groups sync by the Quadratic Synchronisation Rule instead of every
    ``sync_period`` steps: each AB phase after the first lasts ``H - full_rank_steps`` steps with ``H =
    max(h_base, floor((alpha / lr) ** power))`` from the lr of the phase's first step (capped at
    ``total_steps``).  ``h_base`` defaults to ``sync_period``, so ``alpha = 0`` is plain AB.
    ``local_group_steps`` also drops the intra-group traffic of AB steps: each rank trains its factor on its own
    gradients until the group sync (QSR inside the group).

    ``payload="int8"`` (or ``"bf16"``) compresses the world sync: every rank holds the same weights when an AB
    phase begins, so each sends only its change since then (a pseudo-gradient, small and centred), and the mean
    is the phase's start minus the mean change.  QSR's other sync options (outer optimizer, overlap, fragments)
    are not offered for AB: the sync ends the AB phase, the full-rank steps and the next SVD need the synced
    weights at once, and each phase has new bases, so an outer momentum has no fixed coordinates to live in.
    """

    type: Literal["ab"] = "ab"
    warmup_steps: Annotated[int, Field(ge=0, description=(
        "full-rank steps (plain allreduce) before the first AB phase (paper: ~10 % of training)"))] = 4330
    sync_period: Annotated[int, Field(ge=1, description="steps between world syncs (paper: 759, ~1.7 epochs)")] = 759
    full_rank_steps: Annotated[int, Field(ge=0, description=(
        "full-rank steps after each sync, before the truncated re-basis (paper: 60)"))] = 60
    rank_cutoff: Annotated[float, Field(gt=0.0, lt=1.0, description=(
        "keep singular values above rank_cutoff * the largest (paper: 0.15); lower = more accurate, more bytes"))] = 0.15
    group_size: Optional[int] = Field(None, description=(
        "ranks per group: >= 1, -1 = half the world, null = ranks per node (the replica group)"))
    mode: Literal["groups", "only-b"] = Field("groups", description=(
        "groups: half the groups train A, half B; only-b: the whole world trains B"))
    sync: Literal["full", "with-stale"] = Field("full", description=(
        "full: world mean of W (m*n per layer); with-stale: mean of the factors ((m+n)*k, paper's default)"))
    full_rank: List[str] = Field(default_factory=list, description=(
        "fnmatch patterns of parameter names kept dense (e.g. the classifier head)"))
    min_compression_rate: Annotated[float, Field(ge=0.0, description=(
        "layers whose m*n / ((m+n)*k) is below this stay dense"))] = 2.0
    truncate_first: bool = Field(False, description=(
        "cut the first basis too (false: the first phase keeps the dropped part as a frozen residual)"))
    first_rank: Literal["cut", "full"] = Field("cut", description=(
        "cut: the first AB phase trains factors of the cut-off rank (see truncate_first); full: the authors' "
        "code: untruncated factors in the first phase, the cut from the first re-basis on (layers are still "
        "chosen by their cut-off rank's compression)"))
    rebound_steps: Annotated[int, Field(ge=0, description=(
        "LR rebound length after each phase switch (with commhooks.ab.LRRebound; paper: 267)"))] = 0
    sync_rule: Literal["fixed", "qsr"] = Field("fixed", description=(
        "fixed: sync every sync_period; qsr: AB phases sized by the quadratic rule (h_base defaults to sync_period)"))
    h_base: Annotated[Optional[int], Field(ge=1, description=(
        "with sync_rule 'qsr': shortest sync-to-sync period (null = sync_period)"))] = None
    local_group_steps: bool = Field(False, description=(
        "AB steps send nothing inside the group either (each rank trains its factor locally until the sync)"))

    @model_validator(mode="after")
    def _consistent(self) -> "ABConfig":
        if self.group_size is not None and self.group_size < 1 and self.group_size != -1:
            raise ConfigError(f"ab.group_size must be >= 1, -1 (two halves) or null (ranks per node), got {self.group_size}")
        if self.full_rank_steps >= self.sync_period:
            raise ConfigError(
                f"ab.sync_period must be > ab.full_rank_steps, got sync_period={self.sync_period}, "
                f"full_rank_steps={self.full_rank_steps}"
            )
        if self.sync_rule == "qsr" and self.period_base <= self.full_rank_steps:
            raise ConfigError(
                f"ab.h_base must be > ab.full_rank_steps with sync_rule 'qsr', got h_base={self.period_base}, "
                f"full_rank_steps={self.full_rank_steps}"
            )
        return self

    def inactive_keys(self):
        idle = dict(super().inactive_keys())
        if self.sync_rule != "qsr":
            idle.update({k: "with sync_rule 'qsr'" for k in ("alpha", "power", "h_base")})
        elif self.alpha == 0.0:
            idle["power"] = "with alpha > 0 (the rule's exponent)"
            if self.period_base == self.sync_period:
                idle["sync_rule"] = ("with alpha > 0 or an h_base other than sync_period (else the rule's period is "
                                     "sync_period: plain AB)")
        if self.mode == "only-b":
            idle["group_size"] = "in mode 'groups' (only-b trains B on the whole world)"
        elif self.group_size == 1:
            idle["local_group_steps"] = "with groups of several ranks (a group of one sends nothing in an AB step)"
        if self.first_rank == "full":
            idle["truncate_first"] = "with first_rank 'cut' (under 'full' the first phase is not truncated)"
        return idle

    @property
    def period_base(self) -> int:
        """Smallest sync-to-sync period under ``sync_rule="qsr"`` (``h_base``, default ``sync_period``)."""
        return self.sync_period if self.h_base is None else self.h_base
