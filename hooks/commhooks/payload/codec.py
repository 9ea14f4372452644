"""Compressed sync payloads: a pseudo-gradient in fp32, bf16, int8, int4, int2 or top-k, with the step proof, in one
collective.

DiLoCo-style syncs send the *pseudo-gradient* (weights at the last sync minus local weights), which tolerates low
precision far better than the weights themselves: it is small, centred on zero, and averaged over ranks. INTELLECT-1
sends it in int8 (400x less than DDP); Streaming DiLoCo in 4 bits; MuLoCo reports 2 bits with error feedback;
SparseLoCo top-k at 1-3 % density.

Codecs (``payload`` key; a :class:`Codec` carries the settings):

* ``fp32``: 4 bytes per element, summed by an allreduce (exact mean).
* ``bf16``: 2 bytes per element; relative error per element at most 2^-8 (bf16 keeps 8 significant bits; round to
  nearest loses at most half a unit of the last one).
* ``int8`` / ``int4`` / ``int2``: ``b`` bits per element, packed (8 / 2 / 4 elements per byte), plus one fp32
  scale per block of ``payload_block`` elements: codes in ``[-q, q]`` with ``q = 2^(b-1) - 1`` (127, 7, 1: int2 is
  ternary, -1 / 0 / +1), ``scale = absmax / q``.  Round to nearest: error per element at most ``scale / 2 = absmax
  / (2q)`` (/254, /14, /2).  Stochastic rounding (``payload_rounding``): unbiased, error below one ``scale``; its
  random numbers come from a generator seeded by the rank and the step, so a resumed run draws the same ones.
  Smaller blocks follow outliers more closely at 4 bytes per block.
* ``topk``: per chunk of ``topk_chunk`` consecutive elements, the ``ceil(topk_density * chunk)`` of largest
  magnitude, as 2-byte indices in the chunk and their values (fp32, or a dense codec above with one scale per
  chunk: ``topk_values``).  Chunking (as DeMo and SparseLoCo do) keeps one huge tensor from taking every slot.
  Everything else is dropped: use ``error_feedback``, which carries it into the next sync.

A sum of integer codes would overflow, and Horovod's allreduce refuses bf16 and 8-bit tensors, so compressed
payloads are averaged by the ranks themselves: by **allgather** of packed bytes (step proof, payload), every rank
decoding the others' contributions and accumulating them in fp32, in rank order, so every rank gets the identical
mean (each rank receives ``size - 1`` payloads); or, from 3 ranks, by a **two-step exchange** whose bytes per rank
stay under two payloads whatever the world (``payload_exchange``, :mod:`.exchange`).

Error feedback (``error_feedback``): what the codec lost this sync is added to the next sync's pseudo-gradient, so
rounding errors do not accumulate into drift (tested: the residual is carried exactly).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..comm import Comm, Work
from ..comm.base import unflatten_into
from .exchange import OwnerFeedback, TwoStep

CODECS = ("fp32", "bf16", "int8", "int4", "int2", "topk")
EXCHANGES = ("auto", "allgather", "two_step")
TWO_STEP_FROM = 3  # ``auto``: the two-step exchange from this many ranks in the averaging group
DENSE_BITS = {"int8": 8, "int4": 4, "int2": 2}
ROUNDINGS = ("nearest", "stochastic")
TOPK_VALUES = ("fp32", "bf16", "int8", "int4", "int2")


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a payload is encoded: the codec's name and its settings (see the module docstring)."""

    name: str = "fp32"
    block: int = 256  # int8/int4/int2: elements per scale
    rounding: str = "nearest"  # int8/int4/int2: "nearest" or "stochastic"
    density: float = 0.01  # topk: the share of each chunk sent
    chunk: int = 4096  # topk: elements per chunk (<= 65536: indices are 2 bytes)
    values: str = "fp32"  # topk: how the chosen values travel
    exchange: str = "auto"  # how a compressed mean travels: "auto", "allgather", "two_step" (:mod:`.exchange`)

    @classmethod
    def of(cls, codec, block: int = 256) -> "Codec":
        return codec if isinstance(codec, Codec) else cls(codec, block)

    @property
    def k(self) -> int:
        """topk: elements sent per chunk."""
        return max(1, math.ceil(self.density * self.chunk))

    def nbytes(self, numel: int) -> int:
        """Bytes of one rank's encoded payload (without the step proof)."""
        if self.name == "fp32":
            return 4 * numel
        if self.name == "bf16":
            return 2 * numel
        if self.name in DENSE_BITS:
            return _packed_len(numel, DENSE_BITS[self.name]) + 4 * math.ceil(numel / self.block)
        chunks = math.ceil(numel / self.chunk)
        k = min(self.k, self.chunk)
        return 2 * chunks * k + self._values_codec().nbytes(chunks * k)

    def _values_codec(self) -> "Codec":
        return Codec(self.values, block=min(self.k, self.chunk), rounding=self.rounding)

    def exchange_for(self, size: int) -> Optional[TwoStep]:
        """The two-step exchange for a group of ``size`` ranks, or None where the payload goes by one collective
        (fp32's allreduce, or the allgather)."""
        if self.name == "fp32" or resolve(self.exchange, size) != "two_step":
            return None
        return TwoStep(self, size)

    def encode(self, x: torch.Tensor, seed: Optional[int] = None) -> torch.Tensor:
        """``x`` (flat fp32) as bytes (uint8).  ``seed``: the stochastic rounding's (the rank and the step)."""
        if self.name == "fp32":
            return x.contiguous().view(torch.uint8)
        if self.name == "bf16":
            return x.to(torch.bfloat16).view(torch.uint8)
        if self.name in DENSE_BITS:
            return _encode_dense(x, DENSE_BITS[self.name], self.block, self.rounding, seed)
        return self._encode_topk(x, seed)

    def decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        """The flat fp32 tensor :meth:`encode` made ``data`` from (up to the codec's error)."""
        if self.name == "fp32":
            return data.view(torch.float32)
        if self.name == "bf16":
            return data.view(torch.bfloat16).float()
        if self.name in DENSE_BITS:
            return _decode_dense(data, DENSE_BITS[self.name], numel, self.block)
        return self._decode_topk(data, numel)

    def sum_in_rank_order(self, chunks, numel: int, proof: torch.Tensor, device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every rank's step proof and decoded payload summed in fp32, in rank order, so every rank summing the
        same ``chunks`` (one per rank, in group-rank order: the proof's float32 bytes, then this codec's
        bytes of ``numel`` elements) gets bitwise the same ``(total, proofs)``.  The allgather's mean and
        each owner's piece of the two-step exchange."""
        head = 4 * proof.numel()
        total = torch.zeros(numel, dtype=torch.float32, device=device)
        proofs = torch.zeros_like(proof, dtype=torch.float32)
        for chunk in chunks:
            proofs += chunk[:head].clone().view(torch.float32).to(proofs.device)
            total += self.decode(chunk[head:].clone(), numel)
        return total, proofs

    def _encode_topk(self, x: torch.Tensor, seed: Optional[int]) -> torch.Tensor:
        rows = _rows(x, self.chunk)
        k = min(self.k, self.chunk)
        idx = rows.abs().topk(k, dim=1).indices.sort(dim=1).values  # sorted: equal payloads for equal inputs
        values = rows.gather(1, idx).reshape(-1)
        return torch.cat([idx.to(torch.int16).reshape(-1).view(torch.uint8),
                          self._values_codec().encode(values, seed)])

    def _decode_topk(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        chunks, k = math.ceil(numel / self.chunk), min(self.k, self.chunk)
        head = 2 * chunks * k
        idx = data[:head].view(torch.int16).to(torch.int64).reshape(chunks, k) & 0xFFFF  # chunk <= 65536
        values = self._values_codec().decode(data[head:].clone(), chunks * k).reshape(chunks, k)  # (aligned)
        out = torch.zeros(chunks, self.chunk, dtype=torch.float32, device=data.device)
        out.scatter_(1, idx, values)
        return out.reshape(-1)[:numel]


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` zero-padded to whole rows of ``width`` and viewed as them."""
    n = x.numel()
    rows = math.ceil(n / width)
    padded = torch.zeros(rows * width, dtype=torch.float32, device=x.device)
    padded[:n] = x
    return padded.view(rows, width)


def _packed_len(numel: int, bits: int) -> int:
    return math.ceil(numel * bits / 8)


def _encode_dense(x: torch.Tensor, bits: int, block: int, rounding: str, seed: Optional[int]) -> torch.Tensor:
    q = 2 ** (bits - 1) - 1
    n = x.numel()
    rows = _rows(x, block)
    scales = rows.abs().amax(dim=1) / q
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = rows / safe[:, None]
    if rounding == "stochastic":
        g = torch.Generator(device=x.device).manual_seed(int(seed or 0) % (2 ** 63))
        scaled = torch.floor(scaled + torch.rand(scaled.shape, generator=g, device=x.device))
    else:
        scaled = torch.round(scaled)
    codes = scaled.clamp_(-q, q).to(torch.int8).reshape(-1)[:n]
    if bits == 8:
        packed = codes.view(torch.uint8)
    else:
        per = 8 // bits
        unsigned = (codes.to(torch.int16) + q).to(torch.uint8)  # in [0, 2q]
        unsigned = torch.nn.functional.pad(unsigned, (0, (-n) % per)).view(-1, per)
        shifts = torch.arange(per, dtype=torch.uint8, device=x.device) * bits
        packed = (unsigned << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)  # disjoint bits: sum = or
    return torch.cat([scales.view(torch.uint8), packed])


def _decode_dense(data: torch.Tensor, bits: int, numel: int, block: int) -> torch.Tensor:
    q = 2 ** (bits - 1) - 1
    blocks = math.ceil(numel / block)
    scales = data[: 4 * blocks].view(torch.float32)
    packed = data[4 * blocks:]
    if bits == 8:
        codes = packed.view(torch.int8).float()
    else:
        per = 8 // bits
        shifts = torch.arange(per, dtype=torch.uint8, device=data.device) * bits
        mask = (1 << bits) - 1
        unsigned = (packed[:, None] >> shifts) & mask
        codes = unsigned.reshape(-1)[:numel].to(torch.int16).float() - q
    return codes * scales.repeat_interleave(block)[:numel]


def payload_nbytes(numel: int, codec, block: int = 256) -> int:
    """Bytes of one rank's encoded payload (without the step proof)."""
    return Codec.of(codec, block).nbytes(numel)


def encode(x: torch.Tensor, codec, block: int = 256, seed: Optional[int] = None) -> torch.Tensor:
    """``x`` (flat fp32) as bytes (uint8)."""
    return Codec.of(codec, block).encode(x, seed)


def decode(data: torch.Tensor, codec, numel: int, block: int = 256) -> torch.Tensor:
    """The flat fp32 tensor that :func:`encode` made ``data`` from (up to the codec's error)."""
    return Codec.of(codec, block).decode(data, numel)


def round_trip(x: torch.Tensor, codec, block: int = 256, seed: Optional[int] = None) -> torch.Tensor:
    """What a peer decodes from this rank's ``x``."""
    c = Codec.of(codec, block)
    return c.decode(c.encode(x, seed), x.numel())


def start_mean(comm: Comm, x: torch.Tensor, codec, block: int, proof: torch.Tensor, group=None,
               tag: str = "sync", sent: Optional[torch.Tensor] = None, packed: Optional[torch.Tensor] = None,
               seed: Optional[int] = None, feedback: Optional[OwnerFeedback] = None) -> Work:
    """Start averaging ``x`` (flat fp32) and ``proof`` (float32) over ``group``; the returned :class:`Work`'s
    ``wait()`` gives ``(mean, mean_proof)``.

    ``fp32``: one allreduce.  Other codecs: one allgather of the packed bytes, every rank decoding and summing
    in rank order (identical results everywhere), or the two-step exchange (:mod:`.exchange`, the codec's
    ``exchange`` for this group's size).  ``sent``: this rank's encoded bytes when the caller already made them
    (error feedback needs them too; for the two-step exchange, its pieces).  ``seed``: stochastic rounding's;
    ``feedback``: the two-step owner's error feedback.  ``packed`` (fp32): a buffer the caller reuses across
    syncs, holding ``proof`` then ``x`` already (``x`` a view of it), reduced in place; without it the
    collective works on its own copy, and ``x`` may change after the call.
    """
    codec = codec if isinstance(codec, Codec) else Codec.of(codec, block)
    size = comm.size if group is None else group.size
    if codec.name == "fp32":
        both = packed if packed is not None else torch.cat([proof.to(x.device), x])
        work = comm.allreduce([both], op="mean", group=group, tag=tag, async_op=True)
        return work.then(lambda out: (out[0][proof.numel():], out[0][: proof.numel()]))
    two_step = codec.exchange_for(size)
    if two_step is not None:
        return two_step.start(comm, x, proof, group, tag, sent=sent, seed=seed, feedback=feedback)
    body = sent if sent is not None else codec.encode(x, seed)
    packed_bytes = torch.cat([proof.to(x.device).contiguous().view(torch.uint8), body])
    work = comm.allgather(packed_bytes, group=group, tag=tag, async_op=True)
    numel, device = x.numel(), x.device

    def decode_all(chunks):  # a mean over the members that answered (len(chunks): size, unless one was lost)
        total, proofs = codec.sum_in_rank_order(chunks, numel, proof, device)
        return total / len(chunks), proofs / len(chunks)

    return work.then(decode_all)


def resolve(exchange: str, size: int) -> str:
    """``allgather`` or ``two_step``: ``exchange`` with ``auto`` decided by the averaging group's ``size``."""
    if exchange not in EXCHANGES:
        raise ValueError(f"payload_exchange must be one of {EXCHANGES}, got {exchange!r}")
    if exchange == "auto":
        return "two_step" if size >= TWO_STEP_FROM else "allgather"
    return exchange


# ------------------------------------------------------------ the change since a start, averaged compressed


def reused(buffers: Dict[str, torch.Tensor], name: str, numel: int, device) -> torch.Tensor:
    """A flat fp32 buffer kept across syncs in ``buffers`` (made again only if the size or the device changed)."""
    buf = buffers.get(name)
    if buf is None or buf.numel() != numel or buf.device != device:
        buf = buffers[name] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf


def flat_into(buf: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``tensors`` copied one after the other into the flat ``buf``; returns ``buf``."""
    offset = 0
    for t in tensors:
        buf[offset: offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return buf


def write_flat(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """The flat ``flat`` written back into ``tensors`` (cast to each one's dtype)."""
    unflatten_into(flat, [t.data for t in tensors])


def start_change_mean(comm: Comm, tensors: Sequence[torch.Tensor], anchor: torch.Tensor, codec, proof: torch.Tensor,
                      buffers: Dict[str, torch.Tensor], group=None, tag: str = "sync", seed: Optional[int] = None,
                      error_feedback: bool = False, residual: Optional[torch.Tensor] = None,
                      feedback: Optional[OwnerFeedback] = None, sent_from: Optional[torch.Tensor] = None,
                      residual_decay: float = 1.0) -> Tuple[Work, Optional[torch.Tensor]]:
    """Start averaging ``anchor - tensors`` (the change since ``anchor``, plus ``residual_decay`` times the last
    ``residual``) through ``codec``, the step proof riding along; returns the :class:`Work` (``wait()``: ``(mean
    change, mean proof)``) and, with ``error_feedback``, what the codec lost of it (None for fp32).
    ``sent_from``: a buffer that keeps the weights sent from; ``buffers``: the caller's reused send buffers;
    ``feedback``: the two-step exchange's owner residual."""
    n, p, device = sum(map(torch.numel, tensors)), proof.numel(), tensors[0].device
    packed = None
    if codec.name == "fp32":  # the allreduce's buffer: the proof, then the change
        packed = reused(buffers, "send", p + n, device)
        packed[:p].copy_(proof)
        delta = packed[p:]
    else:
        delta = reused(buffers, "delta", n, device)
    if sent_from is not None:
        torch.sub(anchor, flat_into(sent_from, tensors), out=delta)
    else:  # the weights straight into the send buffer, then anchor - weights in place
        torch.sub(anchor, flat_into(delta, tensors), out=delta)
    if residual is not None:
        delta.add_(residual, alpha=residual_decay)  # (alpha 1: exactly delta += residual)
    sent, lost = None, None
    if codec.name != "fp32":
        way = codec.exchange_for(comm.size if group is None else group.size) or codec  # two-step: piece by piece
        sent = way.encode(delta, seed)
        if error_feedback:
            reuse = residual is not None and residual.numel() == n and residual.device == device
            lost = torch.sub(delta, way.decode(sent, n),
                             out=residual if reuse else torch.empty(n, dtype=torch.float32, device=device))
    return start_mean(comm, delta, codec, codec.block, proof, group=group, tag=tag, sent=sent, packed=packed,
                      seed=seed, feedback=feedback), lost


def compressed_mean(comm: Comm, tensors: Sequence[torch.Tensor], start: torch.Tensor, codec, proof: torch.Tensor,
                    buffers: Dict[str, torch.Tensor], tag: str = "sync", seed: Optional[int] = None) -> torch.Tensor:
    """``tensors`` become the world mean, as ``start`` (flat fp32, changed in place) minus the mean of the ranks'
    changes since ``start`` sent through ``codec`` (AB's compressed sync); returns the ranks' mean proof."""
    work, _ = start_change_mean(comm, tensors, start, codec, proof, buffers, tag=tag, seed=seed)
    mean, proofs = work.wait()
    start -= mean.to(start.device)
    write_flat(tensors, start)
    return proofs
