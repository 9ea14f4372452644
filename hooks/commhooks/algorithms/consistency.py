"""Checks that turn silent divergence and hangs into clear errors, on every rank at once.

Each check is collective (a few bytes, not metered): every rank learns the
verdict from the same reduction, so all of them raise together instead of one
raising while the others wait for it at the next collective.

* :func:`verify_same_everywhere` at start-up: a hash of the hook config, the
  world layout and the package version must be equal on all ranks.
* :func:`verify_identical` after a sync: per-tensor checksums must agree;
  otherwise the error names the tensors that diverged.
* :func:`nonfinite_anywhere` before an SVD: a NaN/Inf weight on any rank is
  named, instead of a LinAlgError from deep inside torch.
* :class:`NonfiniteGuard` before a step: a device-side record of NaN/Inf
  gradients, read at the next sync (no host read on a step that does not sync).

Every tensor handed to a collective is made on ``comm.device`` (the synced
tensors' device): an NCCL-only process group refuses CPU tensors.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..comm import Comm
from ..settings import ConfigError


class DivergenceError(RuntimeError):
    """Tensors that must be identical on all ranks are not."""


class NonFiniteError(FloatingPointError):
    """A NaN or Inf where the algorithm cannot go on."""


def spread_over_ranks(comm: Comm, values: torch.Tensor, group=None, tag: str = "check",
                      metered: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Elementwise (max, min) over the ranks, in one call (unmetered unless ``metered``)."""
    both = torch.cat([values, -values])
    comm.allreduce([both], op="max", group=group, tag=tag, metered=metered)
    n = values.numel()
    return both[:n], -both[n:]


FINGERPRINT_CHUNK = 1 << 22  # elements turned to float64 at a time (bounded extra memory on a large model)


def fingerprint(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    """Two float64 numbers summarising ``tensors`` (in order): their sum, and their sum weighted by position
    (``index % 251 + 1``), so that moved elements change it too.  Equal tensors give equal fingerprints on every
    rank (the same reductions on the same sizes); no host read."""
    total = torch.zeros(2, dtype=torch.float64, device=device)
    offset = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        for start in range(0, flat.numel(), FINGERPRINT_CHUNK):
            part = flat[start: start + FINGERPRINT_CHUNK].to(device=device, dtype=torch.float64)
            weight = torch.arange(offset + start, offset + start + part.numel(), dtype=torch.float64,
                                  device=device).remainder_(251).add_(1)
            total[0] += part.sum()
            total[1] += (part * weight).sum()
        offset += flat.numel()
    return total


def anywhere(comm: Comm, flag: bool, tag: str = "check") -> bool:
    """Whether ``flag`` holds on any rank of the world (a verdict each rank reached alone, made everyone's): one
    unmetered 4-byte max allreduce and a host read, the same answer on every rank."""
    if comm.size == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=comm.device)
    comm.allreduce([value], op="max", tag=tag, metered=False)
    return bool(value.item())


def same_everywhere(comm: Comm, tensors: Sequence[torch.Tensor], group=None) -> bool:
    """Whether every rank of ``group`` (default: the world) holds the same ``tensors``: their
    :func:`fingerprint` compared by one unmetered max/min allreduce of 32 bytes; one host read, the same answer
    on every rank.  (A NaN anywhere reads as a difference.)"""
    if (comm.size if group is None else group.size) == 1:
        return True
    hi, lo = spread_over_ranks(comm, fingerprint(tensors, comm.device), group=group)
    return bool((hi == lo).all())


def verify_same_everywhere(comm: Comm, what: str, description: dict) -> None:
    """Raise ConfigError on every rank if ``description`` (JSON-able) differs between ranks."""
    if comm.size == 1:
        return  # nobody to disagree with
    digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).digest()
    words = torch.tensor([int.from_bytes(digest[i:i + 3], "big") for i in range(0, 24, 3)], dtype=torch.float64,
                         device=comm.device)
    hi, lo = spread_over_ranks(comm, words)
    if not torch.equal(hi, lo):
        differ = _keys_that_differ(comm, description)  # a second round, only on a mismatch (every rank enters it)
        nested: Dict[str, object] = {}
        for key, value in differ.items():  # back into the description's shape: {"config": {"h_base": 3}}
            outer, _, inner = key.partition(".")
            if inner and isinstance(description.get(outer), dict):
                nested.setdefault(outer, {})[inner] = value
            else:
                nested[key] = value
        mine = json.dumps(nested, sort_keys=True, default=str) if differ else ""
        raise ConfigError(
            f"{what} differs across ranks in {', '.join(differ) or 'a key this rank does not have'} (same hook "
            f"config, world layout and commhooks version are required on every rank); this rank ({comm.rank}) has: "
            f"{mine or json.dumps(description, sort_keys=True, default=str)}"
        )


_SLOTS = 4096  # (32 kB, on the error path only: two keys share a slot rarely, then both are named)


def _keys_that_differ(comm: Comm, description: dict) -> Dict[str, object]:
    """The keys of ``description`` (one level into dicts: ``config.h_base``) whose values differ on some rank, with
    this rank's values.  Each key's digest is summed into one of a fixed number of slots (chosen by the key's
    name), so the ranks' tensors line up even when their keys differ."""
    flat: Dict[str, object] = {}
    for key, value in description.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    slot = {k: int.from_bytes(hashlib.sha256(k.encode()).digest()[:2], "big") % _SLOTS for k in flat}
    sums = torch.zeros(_SLOTS, dtype=torch.float64, device=comm.device)
    for k, v in flat.items():
        digest = hashlib.sha256(f"{k}={json.dumps(v, sort_keys=True, default=str)}".encode()).digest()
        sums[slot[k]] += int.from_bytes(digest[:3], "big")  # sums of 24-bit integers: exact in float64
    hi, lo = spread_over_ranks(comm, sums)
    bad = set((hi != lo).nonzero().reshape(-1).tolist())  # one host read, on the error path
    return {k: v for k, v in flat.items() if slot[k] in bad}


def verify_identical(comm: Comm, named: Sequence[Tuple[str, torch.Tensor]], when: str, group=None) -> None:
    """Raise DivergenceError on every rank of ``group`` (default: the world), naming the tensors whose
    checksums differ."""
    if (comm.size if group is None else group.size) == 1 or not named:
        return
    sums = torch.stack([torch.stack([t.detach().double().sum(), t.detach().double().abs().sum()]).to(comm.device)
                        for _, t in named])
    hi, lo = spread_over_ranks(comm, sums.reshape(-1), group=group)
    differ = (hi != lo).reshape(-1, 2).any(dim=1).tolist()  # one host read
    if any(differ):
        names = [n for (n, _), bad in zip(named, differ) if bad]
        raise DivergenceError(f"{when}: {len(names)} tensor(s) differ across ranks: {', '.join(names[:20])}")


def nonfinite_anywhere(comm: Comm, named: Sequence[Tuple[str, torch.Tensor]], when: str) -> None:
    """Raise NonFiniteError on every rank if any rank has a NaN/Inf in one of the tensors (one host read)."""
    if not named:
        return
    flags = torch.stack([(~torch.isfinite(t).all()).to(device=comm.device, dtype=torch.float64)
                         for _, t in named])
    if comm.size > 1:
        comm.allreduce([flags], op="max", tag="check", metered=False)
    bad = flags.tolist()
    if any(bad):
        names = [n for (n, _), f in zip(named, bad) if f]
        raise NonFiniteError(f"{when}: NaN or Inf in {', '.join(names[:20])} (on at least one rank)")


def _values(g: torch.Tensor) -> torch.Tensor:
    """The stored values of a gradient: a sparse one's (``nn.Embedding(sparse=True)``) as a dense 1-d tensor
    (its implicit zeros are finite), a dense one as it is."""
    if g.layout == torch.sparse_coo:
        return g._values().reshape(-1)
    if g.layout != torch.strided:  # CSR and friends
        return g.values().reshape(-1)
    return g


def _norms_not_finite(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per gradient, True where its L2 norm is not finite: a NaN or Inf in it, or a norm beyond its dtype's
    range (float32's ~3.4e38: an element near 1.8e19) -- the test ``clip_grad_norm_(error_if_nonfinite=True)``
    makes.  One fused ``torch._foreach_norm`` per (device, dtype) (the L2 norm: torch's fast path on CPU and GPU;
    the inf-norm it replaced cost 15x as much on CPU); stacked on the first gradient's device.  No host read."""
    def not_finite(same: Sequence[torch.Tensor], dtype) -> torch.Tensor:  # one dtype on one device
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None  # half squares summed in fp32
        return ~torch.isfinite(torch.stack(torch._foreach_norm(same, 2, dtype=wide)))

    kinds = {(g.device, g.dtype, g.layout) for g in grads}
    if len(kinds) == 1:  # the usual case, without a loop in Python: dense, one dtype on one device (an empty
        (_, dtype, layout), = kinds  # gradient's norm is 0)
        if layout == torch.strided:
            return not_finite(grads, dtype)
    grads = [_values(g) for g in grads]
    groups: Dict[tuple, List[int]] = defaultdict(list)
    out: List[torch.Tensor] = [grads[0]] * len(grads)  # every slot is filled below
    for i, g in enumerate(grads):
        if g.numel():
            groups[(g.device, g.dtype)].append(i)
        else:  # no element (a sparse gradient of an unused embedding): nothing non-finite
            out[i] = torch.zeros((), dtype=torch.bool, device=g.device)
    for (_, dtype), members in groups.items():
        for i, b in zip(members, not_finite([grads[i] for i in members], dtype)):
            out[i] = b
    device = grads[0].device
    return torch.stack([b.to(device) for b in out])


class NonfiniteGuard:
    """The ``nonfinite`` gradient check before each optimizer step, without stalling a GPU.

    Reading a flag on the host (``bool(...)``, ``.item()``) makes the CPU wait until the GPU's queue
    drains, on every step.  Instead :meth:`observe` records on the device, per parameter, the first step
    whose gradient held a NaN or Inf (its L2 norm not finite: one fused norm per dtype, a few tiny kernels, no
    host read);
    the record is read only where it must be: at the next sync (it rides in the step proof, so every rank
    learns that some rank saw one and all raise together, before a checkpoint could store the bad
    weights) and when a checkpoint is written.  So with ``"raise"`` the error names the step and the
    parameters, raised at the next sync rather than at the step itself.

    ``"skip"`` must decide on the host whether to drop this step's update: one host read per step
    (:meth:`skip_now`), the cost of that policy.
    """

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.first: Optional[torch.Tensor] = None  # int64 per parameter: first bad step, -1 if none
        self._index: Dict[Tuple[int, ...], torch.Tensor] = {}

    def _bad(self, positions: Sequence[int], grads: Sequence[torch.Tensor]) -> torch.Tensor:
        device = grads[0].device
        if self.first is None or self.first.device != device:
            first = torch.full((len(self.names),), -1, dtype=torch.int64, device=device)
            self.first = first if self.first is None else self.first.to(device)
        key = tuple(positions)
        if len(key) == len(self.names) and key == tuple(range(len(key))):  # the usual case: every parameter, in
            return _norms_not_finite(grads)                                # order; no index (a host-to-device copy)
        if key not in self._index:  # made once per set of parameters with gradients
            self._index[key] = torch.tensor(key, dtype=torch.int64, device=device)
        bad = torch.zeros(len(self.names), dtype=torch.bool, device=device)
        bad[self._index[key]] = _norms_not_finite(grads)
        return bad

    def observe(self, named: Sequence[Tuple[int, torch.Tensor]], step: int, record: bool = True) -> Optional[torch.Tensor]:
        """Check this step's gradients ``(position in names, gradient)`` and (``record``) keep the first bad step
        of each parameter; returns the per-parameter bad flags (device tensor), or None without gradients.
        No host read."""
        named = [(i, g) for i, g in named if g is not None]
        if not named:
            return None
        bad = self._bad([i for i, _ in named], [g for _, g in named])
        if record:
            self.first = torch.where(bad & (self.first < 0), step, self.first)
        return bad

    def extend(self, names: Sequence[str]) -> None:
        """Parameters that joined the sync: recorded from now on."""
        self.names += list(names)
        self._index.clear()
        if self.first is not None:
            pad = torch.full((len(names),), -1, dtype=torch.int64, device=self.first.device)
            self.first = torch.cat([self.first, pad])

    def clear(self) -> None:
        """Forget what was seen (a checkpoint was loaded: its weights were written only when finite)."""
        if self.first is not None:
            self.first.fill_(-1)

    def indicator(self, device: torch.device) -> torch.Tensor:
        """1.0 if a bad gradient was seen since the record was cleared, else 0.0 (float32, on ``device``)."""
        if self.first is None:
            return torch.zeros(1, dtype=torch.float32, device=device)
        return (self.first >= 0).any().to(device=device, dtype=torch.float32).reshape(1)

    def seen(self) -> Optional[Tuple[int, List[str]]]:
        """(first bad step, the parameters' names) if any was seen, else None.  Host read."""
        if self.first is None:
            return None
        first = self.first.tolist()
        bad = [(s, n) for s, n in zip(first, self.names) if s >= 0]
        if not bad:
            return None
        step = min(s for s, _ in bad)
        return step, [n for s, n in bad if s == step]

    def message(self, rank: int) -> str:
        seen = self.seen()
        if seen is None:
            return f"none on this rank ({rank}); the rank(s) that saw one name the step and the parameters"
        step, names = seen
        return f"at optimizer step {step} on rank {rank} in: {', '.join(names[:20])}"


def skip_gradients(named: Sequence[Tuple[str, torch.Tensor]], bad: Optional[torch.Tensor]) -> bool:
    """``nonfinite="skip"``: drop every gradient (``grad = None``: torch's optimizers then leave the parameters,
    momentum and weight decay alone) if ``bad`` flags any; True if dropped.  One host read."""
    if bad is None or not bool(bad.any()):
        return False
    for _, p in named:
        p.grad = None
    return True
