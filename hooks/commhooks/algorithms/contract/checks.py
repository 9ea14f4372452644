"""Checks that turn silent divergence and hangs into clear errors, on every rank at once.

Each check is collective (a few bytes, not metered): every rank learns the verdict from the same reduction, so all
of them raise together instead of one raising while the others wait for it at the next collective.

* :func:`verify_same_everywhere` at start-up: a hash of the hook config, the world layout and the package version
  must be equal on all ranks.
* :func:`verify_identical` after a sync: per-tensor checksums must agree; otherwise the error names the tensors
  that diverged.
* :func:`nonfinite_anywhere` before an SVD: a NaN/Inf weight on any rank is named, instead of a LinAlgError from
  deep inside torch.
* :func:`same_everywhere` / :func:`anywhere`: a 32-byte fingerprint comparison, a verdict each rank reached alone
  made everyone's.

Every tensor handed to a collective is made on ``comm.device`` (the synced tensors' device): an NCCL-only process
group refuses CPU tensors.
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...comm import Comm
from ...settings import ConfigError


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


def count_everywhere(comm: Comm, flag: torch.Tensor) -> int:
    """How many ranks hold ``flag`` (a one-element float32 tensor, 1 or 0): one unmetered allreduce, a host read."""
    if comm.size > 1:
        comm.allreduce([flag], op="sum", tag="check", metered=False)
    return int(flag.item())


def first_bad(first: Optional[torch.Tensor], names: Sequence[str]) -> Optional[Tuple[int, List[str]]]:
    """From a NaN guard's record (per parameter, the first bad step or -1): (the first bad step, the names of the
    parameters bad at it), or None.  Host read."""
    bad = [] if first is None else [(s, n) for s, n in zip(first.tolist(), names) if s >= 0]
    if not bad:
        return None
    step = min(s for s, _ in bad)
    return step, [n for s, n in bad if s == step]


STEP_NUMBERING = ("optimizer step N is the Nth optimizer.step() call of the run, counted from 1: `step == N - 1` "
                  "in a loop `for step in range(...)`")


def nonfinite_message(seen: Optional[Tuple[int, List[str]]], rank: int) -> str:
    """What this rank saw (:func:`first_bad`), for the NonFiniteError every rank raises.  The record holds the
    steps taken before the bad one; the message numbers the bad one as :data:`STEP_NUMBERING` says."""
    if seen is None:
        return f"none on this rank ({rank}); the rank(s) that saw one name the step and the parameters"
    return f"at optimizer step {seen[0] + 1} on rank {rank} in: {', '.join(seen[1][:20])}"


def nonfinite_error(name: str, ranks: Optional[int], size: int, where: str, seen: str) -> NonFiniteError:
    """The error of the ``nonfinite="raise"`` guard: ``ranks`` of the world's ``size`` saw a NaN/Inf gradient
    (None: this rank did, the others were not asked), found at ``where``; ``seen``: this rank's
    :func:`nonfinite_message`.  Its start is the same on every rank that counted, so a log's lines match."""
    who = "this rank" if ranks is None else f"{ranks} of {size} ranks"
    return NonFiniteError(
        f"NaN or Inf gradient on {who} since the last sync, found at the {name} {where}: {seen} ({STEP_NUMBERING}; "
        "nonfinite='raise' checks on the device and reads the record at each sync and checkpoint; set "
        "nonfinite='skip' to skip such steps instead)")


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


def flat_description(description: dict) -> Dict[str, object]:
    """``description`` one level into its dicts: ``{"config": {"h_base": 4}}`` -> ``{"config.h_base": 4}``."""
    flat: Dict[str, object] = {}
    for key, value in description.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


_SLOTS = 4096  # (32 kB, on the error path only: two keys share a slot rarely, then both are named)


def _keys_that_differ(comm: Comm, description: dict) -> Dict[str, object]:
    """The keys of ``description`` (one level into dicts: ``config.h_base``) whose values differ on some rank, with
    this rank's values.  Each key's digest is summed into one of a fixed number of slots (chosen by the key's
    name), so the ranks' tensors line up even when their keys differ."""
    flat = flat_description(description)
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
