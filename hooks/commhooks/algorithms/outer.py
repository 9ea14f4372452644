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

The anchor is taken at the first step (after any ``broadcast_parameters``):
the ranks' own weights when they all hold the same (DDP broadcasts them at
construction; a 32-byte fingerprint comparison checks it), else the mean over
the group, so ranks that started from different weights still share one
anchor (one parameter-sized payload, tag ``anchor``).

Memory (fp32, each the size of the tensors synced; :meth:`OuterSync.memory`):
the anchor; the outer momentum (``outer_momentum > 0``); the error-feedback
residual (``error_feedback``; with the two-step exchange also the owner's,
1/size of it); the weights a sync was sent from, kept until it
lands (the progress merge needs them); the send buffer (the pseudo-gradient,
with the step proof in front for fp32); the averaged result until it lands.
The buffers are allocated once and reused at every sync.  For a bf16 model
each fp32 copy costs twice the weights' own bytes.

Any ``torch.optim`` optimizer can be the outer step instead (as in torchft):
``make_optimizer(params) -> optimizer`` is built over the anchor, and a sync
hands it the averaged pseudo-gradient as the anchor's ``.grad``.  The built-in
step above stays the default and the tested reference:
``torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)`` takes the same
steps (to rounding).  Its state is saved with the outer state.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..comm import Comm, Work
from ..comm.base import flatten, unflatten_into
from . import payload
from .exchange import OwnerFeedback


class OuterSync:
    """Anchor, outer momentum and error-feedback residual of the tensors a sync covers (flat fp32)."""

    def __init__(self, lr: float, momentum: float, nesterov: bool, codec: str, block: int, error_feedback: bool,
                 keep_sent_from: bool = True, make_optimizer=None):
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.codec = payload.Codec.of(codec, block)  # a Codec, or a codec's name with its block size
        self.block, self.error_feedback = self.codec.block, error_feedback
        self.keep_sent_from = keep_sent_from  # overlapped syncs merge the progress made since: keep the weights
        self.anchor: Optional[torch.Tensor] = None
        self.buffer: Optional[torch.Tensor] = None  # outer momentum
        self.residual: Optional[torch.Tensor] = None  # error feedback
        self.owner_feedback = OwnerFeedback()  # error feedback of the two-step exchange's second encoding
        self._scratch: Dict[str, torch.Tensor] = {}  # sync buffers, reused at every sync
        self.make_optimizer = make_optimizer  # params -> a torch.optim optimizer taking the outer step (None: built-in)
        self.optimizer: Optional[torch.optim.Optimizer] = None  # over [self.anchor], built at its first step
        self._optimizer_state: Optional[dict] = None  # loaded before the optimizer exists

    @staticmethod
    def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return flatten([t.detach() for t in tensors]).float().clone()

    def _reused(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """A flat fp32 buffer kept across syncs (made again only if the size or the device changed)."""
        buf = self._scratch.get(name)
        if buf is None or buf.numel() != numel or buf.device != device:
            buf = self._scratch[name] = torch.empty(numel, dtype=torch.float32, device=device)
        return buf

    def _flat_into(self, name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``tensors`` concatenated in fp32, into the reused buffer ``name``."""
        numel = sum(t.numel() for t in tensors)
        buf = self._reused(name, numel, tensors[0].device)
        offset = 0
        for t in tensors:
            buf[offset: offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
        return buf

    def memory(self) -> Dict[str, int]:
        """Bytes this outer state keeps, by kind: anchor, momentum, residual, and the reused sync buffers."""
        held = {"anchor": self.anchor, "outer_momentum": self.buffer, "residual": self.residual,
                "owner_residual": self.owner_feedback.value}
        out = {k: v.numel() * v.element_size() for k, v in held.items() if v is not None}
        if self.optimizer is not None:
            kept = sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values()
                       if isinstance(v, torch.Tensor) and v.numel() > 1)
            if kept:
                out["outer_optimizer"] = kept
        scratch = sum(b.numel() * b.element_size() for b in self._scratch.values())
        if scratch:
            out["sync_buffers"] = scratch
        return out

    def take_anchor(self, comm: Comm, tensors: Sequence[torch.Tensor], group=None, averaged: bool = True) -> None:
        """The anchor: the group's mean of ``tensors`` (which every rank then takes as its weights too); with
        ``averaged=False`` (the caller knows every rank holds the same ``tensors``) a copy of them."""
        flat = self._flat(tensors)
        if not averaged:
            self.anchor = flat
            return
        comm.allreduce([flat], op="mean", group=group, tag="anchor")
        self.anchor = flat
        self._write(tensors, flat)

    @torch.no_grad()
    def send(self, comm: Comm, tensors: Sequence[torch.Tensor], proof: torch.Tensor, group=None,
             tag: str = "sync", seed: Optional[int] = None) -> Tuple[Work, torch.Tensor]:
        """Start averaging this rank's pseudo-gradient; returns the in-flight :class:`Work` (its ``wait()``
        gives ``(mean pseudo-gradient, mean proof)``) and the weights it was taken from (flat fp32), which
        :meth:`apply` needs to keep the local progress made while the sync was in flight (None without
        ``keep_sent_from``: a blocking sync needs no copy of them)."""
        n, p, device = sum(t.numel() for t in tensors), proof.numel(), tensors[0].device
        self._to(device)
        packed = None
        if self.codec.name == "fp32":  # the allreduce's buffer: the proof, then the pseudo-gradient
            packed = self._reused("send", p + n, device)
            packed[:p].copy_(proof)
            delta = packed[p:]
        else:
            delta = self._reused("delta", n, device)
        local = None
        if self.keep_sent_from:  # kept until the sync lands (one in flight per fragment)
            local = self._flat_into("sent_from", tensors)
            torch.sub(self.anchor, local, out=delta)
        else:  # the weights straight into the send buffer, then anchor - weights in place
            offset = 0
            for t in tensors:
                delta[offset: offset + t.numel()].copy_(t.detach().reshape(-1))
                offset += t.numel()
            torch.sub(self.anchor, delta, out=delta)
        if self.error_feedback and self.residual is not None:
            delta += self.residual
        sent = None
        if self.codec.name != "fp32":
            size = comm.size if group is None else group.size
            way = self.codec.exchange_for(size) or self.codec  # the two-step exchange encodes piece by piece
            sent = way.encode(delta, seed)  # (the seed: stochastic rounding's)
            if self.error_feedback:
                lost = way.decode(sent, n)
                self.residual = torch.sub(delta, lost, out=self._residual_buffer(n, device))
        feedback = self.owner_feedback if self.error_feedback else None
        return payload.start_mean(comm, delta, self.codec, self.codec.block, proof, group=group, tag=tag, sent=sent,
                                  packed=packed, seed=seed, feedback=feedback), local

    def _residual_buffer(self, numel: int, device) -> torch.Tensor:
        if self.residual is None or self.residual.numel() != numel or self.residual.device != device:
            return torch.empty(numel, dtype=torch.float32, device=device)
        return self.residual

    @torch.no_grad()
    def apply(self, mean: torch.Tensor, tensors: Sequence[torch.Tensor], sent_from: Optional[torch.Tensor] = None,
              merge: str = "progress", alpha: float = 1.0, scale: float = 1.0) -> None:
        """The outer step with the averaged pseudo-gradient ``mean``; then the weights.

        ``scale`` (``outer_normalize="lr_sum"``: the inner learning rates summed over the round): the momentum
        sees ``mean / scale``, a pseudo-gradient per unit of inner lr, so a long late round and a short early
        one feed it on one scale; the step applied is the momentum step times ``scale``.  Without momentum
        that is the plain step, whatever the scale.

        ``sent_from=None`` (a blocking sync): the weights become the new anchor.  Otherwise the sync was in
        flight while the weights moved on from ``sent_from``; ``merge="progress"`` keeps ``alpha`` of that
        progress on top of the new anchor, ``"mix"`` takes ``alpha * local + (1 - alpha) * anchor``
        (Streaming DiLoCo's mixing); ``alpha=0`` in either discards the in-flight steps (torchft)."""
        device = tensors[0].device
        self._to(device)  # after a load onto the CPU
        mean = mean.to(device)
        if scale != 1.0:
            mean = mean / scale
        if self.make_optimizer is not None:
            self._optimizer_step(mean, scale)
        else:
            step = mean
            if self.momentum:
                self.buffer = mean.clone() if self.buffer is None else self.buffer.mul_(self.momentum).add_(mean)
                step = mean + self.momentum * self.buffer if self.nesterov else self.buffer
            self.anchor -= (self.lr * scale) * step if scale != 1.0 else self.lr * step
        if sent_from is None or alpha == 0.0:
            self._write(tensors, self.anchor)
            return
        now = self._flat_into("now", tensors)
        merged = self.anchor + alpha * (now - sent_from.to(device)) if merge == "progress" else (
            alpha * now + (1.0 - alpha) * self.anchor)
        self._write(tensors, merged)

    def _optimizer_step(self, mean: torch.Tensor, scale: float) -> None:
        """The user's outer optimizer steps the anchor with ``mean`` as its gradient (its lr times ``scale``)."""
        if self.optimizer is None or self.optimizer.param_groups[0]["params"][0] is not self.anchor:
            saved = self.optimizer.state_dict() if self.optimizer is not None else self._optimizer_state
            self.optimizer = self.make_optimizer([self.anchor])  # (again after the anchor moved or was loaded)
            if saved is not None:
                self.optimizer.load_state_dict(saved)
            self._optimizer_state = None
        self.anchor.grad = mean
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * scale
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.anchor.grad = None

    def sync(self, comm: Comm, tensors: Sequence[torch.Tensor], proof: torch.Tensor, group=None,
             tag: str = "sync", seed: Optional[int] = None) -> torch.Tensor:
        """One blocking outer step; ``tensors`` become the new anchor.  Returns the mean of the ranks' proofs."""
        work, _ = self.send(comm, tensors, proof, group, tag, seed)
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
        owned = self.owner_feedback.value
        if owned is not None and owned.device != device:
            self.owner_feedback.value = owned.to(device)

    def state_dict(self) -> dict:
        """Copies: the live tensors change in place at the next sync."""
        state = {k: None if v is None else v.clone() for k, v in
                 (("anchor", self.anchor), ("buffer", self.buffer), ("residual", self.residual))}
        if self.owner_feedback.value is not None:  # (absent from checkpoints without a two-step exchange)
            state["owner_residual"] = self.owner_feedback.value.clone()
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else self._optimizer_state
        if optimizer is not None:
            state["optimizer"] = copy.deepcopy(optimizer)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.anchor, self.buffer, self.residual = (None if state[k] is None else state[k].clone()
                                                   for k in ("anchor", "buffer", "residual"))
        owned = state.get("owner_residual")
        self.owner_feedback = OwnerFeedback(None if owned is None else owned.clone())
        if state.get("optimizer") is not None and self.make_optimizer is None:
            raise ValueError("the checkpoint's outer step used an outer_optimizer; pass the same outer_optimizer")
        if state.get("buffer") is not None and self.make_optimizer is not None:
            raise ValueError("the checkpoint's outer step is the built-in one with momentum; its momentum would be "
                             "lost under an outer_optimizer: resume without outer_optimizer")
        self.optimizer, self._optimizer_state = None, copy.deepcopy(state.get("optimizer"))  # (torch keeps tensors)
