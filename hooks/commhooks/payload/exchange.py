"""How a compressed mean travels: one allgather, or a two-step exchange whose bytes do not grow with the world.

A sum of packed integer codes would overflow, so a compressed payload (any codec but fp32, see :mod:`.payload`) is
averaged by the ranks themselves. Two ways to do that, the ``payload_exchange`` key:

* ``allgather``: every rank receives every other rank's whole payload ``P`` and decodes them all: ``(s - 1) P``
  bytes in and ``s`` decodes of the whole tensor per rank for ``s`` ranks.  One round trip.
* ``two_step`` (a reduce-scatter, then an allgather, of compressed pieces: the shape of DeepSpeed's 1-bit Adam
  ``compressed_allreduce`` and of MuLoCo's and SparseLoCo's sharded exchanges): the tensor is cut into ``s``
  pieces; an **all-to-all** hands rank ``i`` the encoded piece ``i`` of every rank (with every rank's step proof),
  rank ``i`` decodes them, averages them in fp32 in rank order, encodes the mean again and an **allgather** of
  those encoded means gives every rank the whole mean.  Per rank: ``2 (s - 1) / s P`` bytes in (at most ``2 P``
  whatever the world), two decodes of the whole. Every rank decodes the same bytes, so every rank gets the
  identical mean.

Which to pick (``auto``, the default; :func:`~.codec.resolve`): ``two_step`` from :data:`~.codec.TWO_STEP_FROM`
ranks in the averaging group, where it receives a third fewer bytes (``4/3 P`` against ``2 P``) and from 4 ranks
half or less; ``allgather`` below (at 2 ranks both receive ``P``, and ``two_step`` would add a round trip and a
second rounding).

The second rounding: the mean is encoded twice, once by each sender (its error is the sender's error feedback) and
once by the piece's owner.  With ``error_feedback`` the owner keeps what its encoding of the mean lost and adds it
to its piece of the next sync's mean (DeepSpeed's "server error" in 1-bit Adam); the residual is saved with the
outer state, so a resume is exact.  Without it the second rounding's error is not carried.

Pieces are ``c`` elements, ``ceil(n / s)`` rounded up to whole scale blocks (``payload_block``) or top-k chunks
(``topk_chunk``), the last ones padded with zeros: a piece's encoding then matches the allgather's block for block
(nearest rounding: the same codes).  For a small tensor in a large world the padding can cost more than it saves;
the planner and ``commhooks plan --config`` show both exchanges' bytes.

When it runs: the all-to-all starts when the sync is sent (and travels while training goes on, with
``overlap_steps``); decoding, the owner's encoding and the allgather run when the sync lands.

The meter counts what this rank hands to each collective: the all-to-all's whole input (``s`` pieces with a proof
each, its own included) and the allgather's one encoded mean.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ..comm import Comm, Work


def piece_numel(codec, numel: int, size: int) -> int:
    """Elements per piece of the two-step exchange (whole blocks / chunks of ``codec``)."""
    align = codec.chunk if codec.name == "topk" else codec.block if codec.name.startswith("int") else 1
    return max(1, math.ceil(math.ceil(numel / size) / align)) * align


@dataclasses.dataclass
class OwnerFeedback:
    """What the owner's encoding of its piece of the mean lost at the last sync (``error_feedback``)."""

    value: Optional[torch.Tensor] = None


def _seed(seed: Optional[int], salt: int, i: int) -> Optional[int]:
    """A distinct stochastic-rounding seed for encoding ``i`` of kind ``salt``, derived from ``seed`` (a function of
    the rank and the step, so a resume draws the same)."""
    return None if seed is None else (seed * 131 + salt * 65_537 + i) % (2 ** 61)


class TwoStep:
    """The two-step exchange of one codec (a :class:`~.codec.Codec`: ``encode``, ``decode``, ``nbytes``,
    ``sum_in_rank_order``) over a group of ``size`` ranks (see the module docstring)."""

    def __init__(self, codec, size: int):
        self.codec, self.size = codec, size

    def layout(self, numel: int):
        c = piece_numel(self.codec, numel, self.size)
        return c, self.codec.nbytes(c)

    def _pieces(self, x: torch.Tensor) -> torch.Tensor:
        c, _ = self.layout(x.numel())
        padded = torch.zeros(c * self.size, dtype=torch.float32, device=x.device)
        padded[: x.numel()] = x
        return padded.view(self.size, c)

    def encode(self, x: torch.Tensor, seed: Optional[int] = None) -> torch.Tensor:
        """The ``size`` encoded pieces of ``x`` (flat fp32), concatenated."""
        return torch.cat([self.codec.encode(p, _seed(seed, 1, i)) for i, p in enumerate(self._pieces(x))])

    def decode(self, sent: torch.Tensor, numel: int) -> torch.Tensor:
        """What :meth:`encode` made ``sent`` from (up to the codec's error): what the owners decode."""
        return self._joined(sent.split(self.layout(numel)[1]), numel)

    def _joined(self, pieces, numel: int) -> torch.Tensor:
        """The ``size`` encoded pieces, decoded and joined into ``numel`` elements (the padding dropped)."""
        c = self.layout(numel)[0]
        return torch.cat([self.codec.decode(p.clone(), c) for p in pieces])[:numel]

    def nbytes(self, numel: int, proof_bytes: int):
        """``(all-to-all input, allgather input)``: the bytes the meter counts for each step."""
        _, nb = self.layout(numel)
        return self.size * (proof_bytes + nb), nb

    def start(self, comm: Comm, x: torch.Tensor, proof: torch.Tensor, group, tag: str,
              sent: Optional[torch.Tensor] = None, seed: Optional[int] = None,
              feedback: Optional[OwnerFeedback] = None) -> Work:
        """Start the all-to-all; the returned :class:`Work`'s ``wait()`` averages this rank's piece, runs the
        allgather and gives ``(mean, mean_proof)``.  ``sent``: :meth:`encode`'s output when the caller made it."""
        numel, device, size = x.numel(), x.device, self.size
        c, nb = self.layout(numel)
        body = sent if sent is not None else self.encode(x, seed)
        head = proof.to(device).float().contiguous().view(torch.uint8)
        hp = head.numel()
        rows = torch.cat([head.expand(size, hp), body.view(size, nb)], dim=1)
        first = comm.alltoall(rows.reshape(-1), group=group, tag=tag, async_op=True)
        owner = group.ranks.index(comm.rank) if group is not None else comm.rank

        def land():
            piece, proofs = self.codec.sum_in_rank_order(first.wait(), c, proof, device)
            piece /= size
            if feedback is not None and feedback.value is not None:
                piece += feedback.value.to(device)
            mine = self.codec.encode(piece, _seed(seed, 2, owner))
            if feedback is not None:
                feedback.value = piece - self.codec.decode(mine, c)
            return self._joined(comm.allgather(mine, group=group, tag=tag), numel), proofs / size

        return Work(land)

    def received_bytes(self, numel: int, proof_bytes: int) -> int:
        """What this rank holds while the exchange lands (the all-to-all's output and the gathered means)."""
        a2a, ag = self.nbytes(numel, proof_bytes)
        return a2a + self.size * ag
