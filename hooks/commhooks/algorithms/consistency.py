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
* :func:`nonfinite_grads` before a step (local: no communication).
"""

from __future__ import annotations

import hashlib
import json
from typing import List, Sequence, Tuple

import torch

from ..comm import Comm
from ..config import ConfigError


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


def verify_same_everywhere(comm: Comm, what: str, description: dict) -> None:
    """Raise ConfigError on every rank if ``description`` (JSON-able) differs between ranks."""
    digest = hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).digest()
    words = torch.tensor([int.from_bytes(digest[i:i + 3], "big") for i in range(0, 24, 3)], dtype=torch.float64)
    hi, lo = spread_over_ranks(comm, words)
    if not torch.equal(hi, lo):
        raise ConfigError(
            f"{what} differs across ranks (same hook config, world layout and commhooks version are required on "
            f"every rank); this rank ({comm.rank}) has: {json.dumps(description, sort_keys=True, default=str)}"
        )


def verify_identical(comm: Comm, named: Sequence[Tuple[str, torch.Tensor]], when: str, group=None) -> None:
    """Raise DivergenceError on every rank of ``group`` (default: the world), naming the tensors whose
    checksums differ."""
    if (comm.size if group is None else group.size) == 1 or not named:
        return
    sums = torch.stack([torch.stack([t.detach().double().sum(), t.detach().double().abs().sum()]) for _, t in named])
    hi, lo = spread_over_ranks(comm, sums.reshape(-1), group=group)
    differ = (hi != lo).reshape(-1, 2).any(dim=1)
    if bool(differ.any()):
        names = [n for (n, _), bad in zip(named, differ.tolist()) if bad]
        raise DivergenceError(f"{when}: {len(names)} tensor(s) differ across ranks: {', '.join(names[:20])}")


def nonfinite_anywhere(comm: Comm, named: Sequence[Tuple[str, torch.Tensor]], when: str) -> None:
    """Raise NonFiniteError on every rank if any rank has a NaN/Inf in one of the tensors."""
    flags = torch.tensor([0.0 if bool(torch.isfinite(t).all()) else 1.0 for _, t in named], dtype=torch.float64)
    if comm.size > 1:
        comm.allreduce([flags], op="max", tag="check", metered=False)
    if bool(flags.any()):
        names = [n for (n, _), f in zip(named, flags.tolist()) if f]
        raise NonFiniteError(f"{when}: NaN or Inf in {', '.join(names[:20])} (on at least one rank)")


def nonfinite_grads(named: Sequence[Tuple[str, torch.Tensor]]) -> List[str]:
    """Names of the parameters whose gradient holds a NaN or Inf (local check).

    Fast path: one sum per gradient, all checked at once (a NaN or Inf makes
    its sum non-finite); only a non-finite sum is confirmed element-wise, so
    a finite gradient whose sum overflows is not reported.
    """
    with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
    if not with_grad:
        return []
    sums = torch.stack([g.sum(dtype=torch.float32) for _, g in with_grad])
    if bool(torch.isfinite(sums).all()):
        return []
    return [n for (n, g), ok in zip(with_grad, torch.isfinite(sums).tolist()) if not ok and not bool(torch.isfinite(g).all())]


def guard_gradients(named: Sequence[Tuple[str, torch.Tensor]], policy: str, step: int, rank: int) -> bool:
    """Apply the ``nonfinite`` policy before an optimizer step; True if the step was skipped.

    ``"skip"`` drops every gradient (``grad = None``: torch's optimizers then
    leave the parameters, momentum and weight decay alone) but the step still
    counts, so the schedule stays the same on every rank.
    """
    bad = nonfinite_grads(named)
    if not bad:
        return False
    if policy == "raise":
        raise NonFiniteError(
            f"NaN or Inf gradient at optimizer step {step} on rank {rank} in: {', '.join(bad[:20])} "
            "(set nonfinite='skip' to skip such steps instead)"
        )
    for _, p in named:
        p.grad = None
    return True
