"""QSR's settings (:class:`QSRConfig`), and the quadratic rule's keys every algorithm that syncs by it declares.

Gu, Lyu, Arora, Zhang, Huang, "A Quadratic Synchronization Rule for Distributed Deep Learning", ICLR 2024 (arXiv
2310.14423).

Every rank runs its own optimizer on its own data; no gradient crosses the network.  After ``H`` optimizer steps the
ranks average their parameters (one flat allreduce), and the next period is chosen from the learning rate the next
step will use::

    H = init_h                                            while step < warmup_steps
    H = max(1, min(total_steps - step,
                   max(h_base, floor((alpha / lr) ** power))))   otherwise

``power=2`` is QSR; 1 and 3 are the comparison rules of the paper; ``alpha=0`` is constant-period local SGD.  As the
lr decays, H grows quadratically, so communication thins out exactly when it matters least for accuracy (the paper
shows it even improves generalisation).

Paper settings: ViT-B / local AdamW, ``h_base=4, alpha=0.0175``, peak lr 0.008, cosine decay, 10k warm-up steps:
syncs on ~10 % of the steps instead of 25 % for constant H=4, with higher top-1 accuracy.

Tuning advice:

* ``h_base`` bounds the drift at peak lr; 2-8 is the useful range.
* ``alpha`` sets where the rule takes over: ``(alpha/lr)**2 > h_base`` once ``lr < alpha / sqrt(h_base)``.  The
  paper's ViT setting puts that point at the peak lr (``alpha ~ peak_lr * sqrt(h_base)``); on MNIST-1D here
  (AdamW, peak lr 0.003, h_base 4) alpha 0.006 syncs on 11 % of the steps and 0.01 on 4.7 %, both at DDP's
  accuracy.
* ``warmup_steps`` must cover the lr warm-up: a tiny warm-up lr would give a huge first period.
* Leave ``average_optimizer_state`` off (the paper's code averages parameters only); turn it on if local Adam
  moments drift apart on very skewed data.
* BatchNorm running statistics are averaged at each sync (``average_buffers``); integer buffers such as
  ``num_batches_tracked`` are left alone.
"""

from __future__ import annotations

from typing import ClassVar, Dict, Literal, Optional

from pydantic import Field
from typing_extensions import Annotated

from ...settings import HookConfig
from ...payload import PayloadFields


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


class QSRConfig(QuadraticRuleFields, PayloadFields):
    """Local SGD / local AdamW synchronised by the Quadratic Synchronisation Rule.

    After a sync, the next round lasts ``H = max(h_base, floor((alpha / lr) ** power))`` optimizer steps
    (``init_h`` while ``step < warmup_steps``; capped at the remaining steps when ``total_steps`` is known; at
    least 1).

    Tuning: ``h_base`` is the period at peak lr (the paper uses 4 for ViT-B and 2 for ResNet).  The rule exceeds
    ``h_base`` once ``lr < alpha / h_base ** (1 / power)``; the paper's ViT setting (alpha 0.0175, peak lr
    0.008, h_base 4) puts that point at the peak, so the rule governs the whole decay: start from ``alpha ~
    peak_lr * sqrt(h_base)`` and raise it to thin communication further. ``warmup_steps`` must cover the lr
    warm-up (a tiny warm-up lr would otherwise give a huge H).  ``alpha = 0`` gives constant ``H = h_base``.

    A sync can be a DiLoCo outer step on the pseudo-gradient (``outer_lr``, ``outer_momentum``) sent in fp32,
    bf16 or int8 (``payload``, with ``error_feedback``), overlapped with the next ``overlap_steps`` local steps
    and staggered in ``fragments``; see :mod:`commhooks.algorithms.qsr.sync` and
    :mod:`commhooks.payload`.  On MNIST-1D the combination QSR periods + outer lr 0.7 / Nesterov 0.9
    + int8 sends 1.3 % of DDP's bytes.

    ``hierarchical`` (replica groups of k ranks, e.g. the GPUs of a node sharing one network card): the ranks of
    a group hold the same weights, so each sends only its 1/k of them across nodes and the group shares the k
    parts over the node's own links afterwards: the node link carries one model's worth of payload per sync
    instead of k (an allgather payload, int8 or bf16, falls further: each part goes to one rank per group).  The
    result is the same sync (identical weights; int8 blocks restart at each part's start).  Turn it on whenever
    a node holds several ranks.
    """

    type: Literal["qsr"] = "qsr"
    schedule_keys: ClassVar[Dict[str, str]] = {"total_steps": "total", "warmup_steps": "warmup"}
    h_base: Annotated[int, Field(ge=1, description=(
        "period at peak lr and the rule's floor (paper: 4 for ViT-B, 2 for ResNet)"))] = 4
    init_h: Annotated[Optional[int], Field(ge=1, description="period while step < warmup_steps (null = h_base)")] = None
    warmup_steps: Annotated[int, Field(ge=0, description=(
        "steps of the lr warm-up: the rule starts after them (a tiny warm-up lr would give a huge period)"))] = 0
    average_optimizer_state: bool = Field(False, description=(
        "also average exp_avg, exp_avg_sq, momentum_buffer at each sync (off in the paper's code)"))
    average_buffers: bool = Field(True, description="average floating buffers (BatchNorm statistics) at each sync")
    group_size: Annotated[Optional[int], Field(ge=1, description=(
        "ranks per replica group: gradients are averaged inside a group every step (fast links), parameters "
        "across groups by the rule; 1 = every rank its own replica (plain local SGD); null = ranks per node"))] = 1
    outer_lr: Annotated[float, Field(gt=0.0, description=(
        "DiLoCo outer step: weights = anchor - outer_lr * (averaged pseudo-gradient, with momentum); 1 with "
        "outer_momentum 0 is plain averaging (DiLoCo: 0.7)"))] = 1.0
    outer_momentum: Annotated[float, Field(ge=0.0, lt=1.0, description=(
        "momentum of the outer step (DiLoCo: 0.9); 0 = none"))] = 0.0
    outer_nesterov: bool = Field(True, description="Nesterov momentum in the outer step (DiLoCo's choice)")
    outer_normalize: Literal["none", "lr_sum"] = Field("none", description=(
        "lr_sum: the outer momentum sees the pseudo-gradient divided by the inner lr summed over its round (a "
        "long late round and a short early one on one scale, as QSR's periods change), the step scaled back; "
        "none: DiLoCo's outer step"))
    error_feedback: bool = Field(False, description=(
        "add what the payload codec lost at a sync to the next sync's pseudo-gradient"))
    error_feedback_decay: Annotated[float, Field(gt=0.0, le=1.0, description=(
        "error_feedback: the carried residual is multiplied by this before it joins the next pseudo-gradient "
        "(SparseLoCo's beta, 0.95: the residual then also serves as the outer momentum, so pair it with "
        "outer_momentum 0; with topk, outer_lr between 1 and the ranks averaged, whose choices differ); "
        "1 = classic error feedback"))] = 1.0
    overlap_steps: Annotated[int, Field(ge=0, description=(
        "apply each sync this many local steps after sending it, training on meanwhile (Streaming DiLoCo's "
        "tau; 0 = blocking); keep it below the shortest period"))] = 0
    overlap_schedule: Literal["land-after", "send-before"] = Field("land-after", description=(
        "where an overlapped sync sits around its point in the round: land-after = sent at the point, landing "
        "overlap_steps later; send-before = sent overlap_steps before the point, landing on it (torchft's "
        "DiLoCo since 2025-07: fragment_sync_delay)"))
    overlap_merge: Literal["progress", "mix"] = Field("progress", description=(
        "how a sync lands: progress = synced weights + overlap_alpha * the local steps made while it was in flight "
        "(an overlapped sync only); mix = overlap_alpha * local + (1 - overlap_alpha) * synced (the paper's "
        "mixing, and torchft's fragment_update_alpha: at a blocking sync too)"))
    overlap_alpha: Annotated[float, Field(ge=0.0, le=1.0, description=(
        "weight of the local side in overlap_merge (progress: 1 keeps every in-flight step; mix: paper 0.5; "
        "0 in either = discard the local side: the synced weights)"))] = 1.0
    fragments: Annotated[int, Field(ge=1, description=(
        "cut the parameters into this many equal runs whose syncs are staggered across the period (the "
        "link carries 1/fragments of the model at a time)"))] = 1
    hierarchical: bool = Field(False, description=(
        "with replica groups of k ranks: each rank syncs 1/k of the parameters with the same part of the "
        "other groups, then the group's ranks share their parts inside the node (k times less traffic "
        "across nodes; Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE for local SGD)"))

    def inactive_keys(self):
        idle = dict(super().inactive_keys())
        if self.alpha == 0.0:
            idle["power"] = "with alpha > 0 (the rule's exponent)"
        if self.warmup_steps == 0:
            idle["init_h"] = "with warmup_steps > 0 (the period during the warm-up)"
        if self.alpha == 0.0 and self.init_h is None:
            idle["warmup_steps"] = ("with alpha > 0 (the rule starts after the warm-up) or an init_h (the period "
                                    "during it); with neither, every period is h_base")
        if self.outer_momentum == 0.0:
            idle["outer_nesterov"] = "with outer_momentum > 0"
        if self.payload == "fp32":
            idle["error_feedback"] = "with a compressed payload (fp32 loses nothing to carry over)"
        if not self.error_feedback:
            idle["error_feedback_decay"] = "with error_feedback true (it decays the error-feedback residual)"
        if self.overlap_steps == 0:
            idle["overlap_schedule"] = "with overlap_steps > 0 (where an overlapped sync is sent and lands)"
            if self.overlap_merge == "progress":  # a blocking sync leaves no progress to keep; "mix" still mixes
                idle["overlap_alpha"] = "with overlap_steps > 0, or overlap_merge 'mix' (torchft's mixing)"
        if self.group_size == 1:
            idle["hierarchical"] = "with replica groups of several ranks (group_size > 1, or null: ranks per node)"
        return idle

    @property
    def pseudo_gradient(self) -> bool:
        """True when a sync is an outer step on the pseudo-gradient (outer optimizer or compressed payload)."""
        return (self.outer_lr != 1.0 or self.outer_momentum != 0.0 or self.payload != "fp32"
                or self.overlap_steps > 0 or self.fragments > 1 or self.outer_normalize != "none"
                or self.mixes_at_sync)

    @property
    def streaming(self) -> bool:
        """True when a round can end with the ranks' weights apart (overlapped or fragmented syncs, or a sync that
        mixes each rank's own weights back in)."""
        return self.overlap_steps > 0 or self.fragments > 1 or self.mixes_at_sync

    @property
    def mixes_at_sync(self) -> bool:
        """A sync lands as a mix of the local and the synced weights that keeps some of the local side."""
        return self.overlap_merge == "mix" and self.overlap_alpha > 0.0

    @property
    def warmup_h(self) -> int:
        """Period used while ``step < warmup_steps`` (``init_h``, default ``h_base``)."""
        return self.h_base if self.init_h is None else self.init_h
