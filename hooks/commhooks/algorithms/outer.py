"""The DiLoCo outer step: a sync as an optimizer step on the pseudo-gradient.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models", arXiv 2311.08105; torchft's ``local_sgd.DiLoCo``.

Each rank keeps the weights of the last sync, the *anchor* ``theta``.  At a
sync every rank sends its pseudo-gradient ``delta_i = theta - theta_i``
(possibly compressed, see :mod:`.payload`), the ranks average it, and an
outer optimizer steps the anchor; every rank then continues from it::

    d     = mean_i delta_i
    m     = mu * m + d                      (outer momentum buffer)
    step  = d + mu * m   (Nesterov)   or   m
    theta = theta - outer_lr * step          ->  every rank's weights = theta

With ``outer_lr = 1`` and ``mu = 0`` this is ``theta - mean_i(theta -
theta_i) = mean_i theta_i``: plain parameter averaging, what QSR does by
default (the default path averages the weights directly and keeps no anchor;
the tests check the two agree).  DiLoCo's setting is outer_lr 0.7, Nesterov
momentum 0.9; the payload can then be bf16 or int8 with little loss, because
the outer step averages and smooths the pseudo-gradients.

Tuning: start from lr 0.7 / momentum 0.9 with periods of tens to hundreds of
steps; with the short periods QSR picks at peak lr (h_base 2-8), momentum
amplifies small pseudo-gradients and lr 1 / momentum 0 with a compressed
payload is the safer choice.  ``error_feedback`` carries what the codec lost
into the next sync.

The anchor is taken at the first step (after any ``broadcast_parameters``)
as the mean over the group, so ranks that started from different weights
still share one anchor (one parameter-sized payload, tag ``anchor``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..comm import Comm, Work
from ..comm.base import flatten, unflatten_into
from . import payload


class OuterSync:
    """Anchor, outer momentum and error-feedback residual of the tensors a sync covers (flat fp32)."""

    def __init__(self, lr: float, momentum: float, nesterov: bool, codec: str, block: int, error_feedback: bool):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.codec, self.block, self.error_feedback = codec, block, error_feedback
        self.anchor: Optional[torch.Tensor] = None
        self.buffer: Optional[torch.Tensor] = None  # outer momentum
        self.residual: Optional[torch.Tensor] = None  # error feedback

    @staticmethod
    def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return flatten([t.detach() for t in tensors]).float().clone()

    def take_anchor(self, comm: Comm, tensors: Sequence[torch.Tensor], group=None) -> None:
        """The anchor: the group's mean of ``tensors`` (which every rank then takes as its weights too)."""
        flat = self._flat(tensors)
        comm.allreduce([flat], op="mean", group=group, tag="anchor")
        self.anchor = flat
        self._write(tensors, flat)

    @torch.no_grad()
    def send(self, comm: Comm, tensors: Sequence[torch.Tensor], proof: torch.Tensor, group=None,
             tag: str = "sync") -> Tuple[Work, torch.Tensor]:
        """Start averaging this rank's pseudo-gradient; returns the in-flight :class:`Work` (its ``wait()``
        gives ``(mean pseudo-gradient, mean proof)``) and the weights it was taken from (flat fp32), which
        :meth:`apply` needs to keep the local progress made while the sync was in flight."""
        local = self._flat(tensors)
        self._to(local.device)
        delta = self.anchor - local
        if self.error_feedback and self.residual is not None:
            delta += self.residual
        sent = None
        if self.codec != "fp32":
            sent = payload.encode(delta, self.codec, self.block)
            if self.error_feedback:
                self.residual = delta - payload.decode(sent, self.codec, delta.numel(), self.block)
        return payload.start_mean(comm, delta, self.codec, self.block, proof, group=group, tag=tag, sent=sent), local

    @torch.no_grad()
    def apply(self, mean: torch.Tensor, tensors: Sequence[torch.Tensor], sent_from: Optional[torch.Tensor] = None,
              merge: str = "progress", alpha: float = 1.0) -> None:
        """The outer step with the averaged pseudo-gradient ``mean``; then the weights.

        ``sent_from=None`` (a blocking sync): the weights become the new anchor.  Otherwise the sync was in
        flight while the weights moved on from ``sent_from``; ``merge="progress"`` keeps ``alpha`` of that
        progress on top of the new anchor, ``"mix"`` takes ``alpha * local + (1 - alpha) * anchor``
        (Streaming DiLoCo's mixing); ``alpha=0`` in either discards the in-flight steps (torchft)."""
        device = tensors[0].device
        self._to(device)  # after a load onto the CPU
        mean = mean.to(device)
        step = mean
        if self.momentum:
            self.buffer = mean.clone() if self.buffer is None else self.buffer.mul_(self.momentum).add_(mean)
            step = mean + self.momentum * self.buffer if self.nesterov else self.buffer
        self.anchor -= self.lr * step
        if sent_from is None or alpha == 0.0:
            self._write(tensors, self.anchor)
            return
        now = self._flat(tensors)
        merged = self.anchor + alpha * (now - sent_from.to(device)) if merge == "progress" else (
            alpha * now + (1.0 - alpha) * self.anchor)
        self._write(tensors, merged)

    def sync(self, comm: Comm, tensors: Sequence[torch.Tensor], proof: torch.Tensor, group=None,
             tag: str = "sync") -> torch.Tensor:
        """One blocking outer step; ``tensors`` become the new anchor.  Returns the mean of the ranks' proofs."""
        work, _ = self.send(comm, tensors, proof, group, tag)
        mean, proofs = work.wait()
        self.apply(mean, tensors)
        return proofs

    @staticmethod
    def _write(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        unflatten_into(flat, [t.data for t in tensors])  # copy_ casts to each tensor's dtype

    def _to(self, device) -> None:
        """After a load onto the CPU: the state goes where the parameters are."""
        for key in ("anchor", "buffer", "residual"):
            value = getattr(self, key)
            if value is not None and value.device != device:
                setattr(self, key, value.to(device))

    def state_dict(self) -> dict:
        """Copies: the live tensors change in place at the next sync."""
        return {k: None if v is None else v.clone() for k, v in
                (("anchor", self.anchor), ("buffer", self.buffer), ("residual", self.residual))}

    def load_state_dict(self, state: dict) -> None:
        self.anchor, self.buffer, self.residual = (None if state[k] is None else state[k].clone()
                                                   for k in ("anchor", "buffer", "residual"))
