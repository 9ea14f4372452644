"""The transitions of AB-training: entering a phase (new bases, collective) and what the world sync averages.

Functions of the parameters, the config and a :class:`Comm`; the state (:mod:`commhooks.algorithms.ab.state`)
decides when to call them and sends the sync.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...comm import Comm
from ...settings import ConfigError
from ..contract.checks import nonfinite_anywhere, spread_over_ranks
from ..contract.parameters import user_stacklevel
from .config import ABConfig
from .lowrank import Basis, basis_from_svd, compression_ratio, rank_of, svd, tall_view


@torch.no_grad()
def enter(comm: Comm, candidates: Sequence[Tuple[str, torch.Tensor]], config: ABConfig, keep_residual: bool,
          when: str, untruncated: bool = False) -> Tuple[Dict[str, Basis], Dict[str, Optional[int]]]:
    """New bases for the compressible weights; W becomes A B (or A B + residual).

    The rank of each weight is agreed as the MAX over all ranks; a layer whose compression at that rank is below
    ``min_compression_rate`` stays dense (rank ``None``).  ``untruncated`` (the authors' first entry): a chosen
    layer's factors keep every component (W = A B exactly).  Returns ``(bases, ranks)``, ranks as trained.
    """
    nonfinite_anywhere(comm, candidates, f"AB re-basis {when}: the SVD needs finite weights")
    mats = [tall_view(p.data)[0] for _, p in candidates]
    svds = [svd(m) for m in mats]
    ks = torch.stack([rank_of(s, config.rank_cutoff).to(comm.device) for _, s, _ in svds]) if svds else \
        torch.zeros(0, dtype=torch.float64, device=comm.device)
    comm.allreduce([ks], op="max", tag="basis")  # rank agreed as the max over all ranks
    bases: Dict[str, Basis] = {}
    ranks: Dict[str, Optional[int]] = {}
    for (name, _), mat, (u, s, vh), k in zip(candidates, mats, svds, ks.long().tolist()):
        m, n = mat.shape
        if compression_ratio(m, n, k) < config.min_compression_rate:
            ranks[name] = None
            continue
        if untruncated:
            k = s.numel()
        bases[name] = basis_from_svd(u, s, vh, k, mat.dtype)
        ranks[name] = k
    agree(comm, bases)
    params = dict(candidates)
    for name, basis in bases.items():
        mat = tall_view(params[name].data)[0]
        if keep_residual:
            basis.residual = mat - basis.a @ basis.b
        else:
            mat.copy_(basis.a @ basis.b)  # the dropped singular values leave the model
    return bases, ranks


def agree(comm: Comm, bases: Dict[str, Basis]) -> None:
    """Check the factors are identical on every rank; broadcast rank 0's where they are not."""
    if not bases or comm.size == 1:
        return
    names = sorted(bases)
    sums = torch.stack([t.double().sum().to(comm.device) for n in names for t in (bases[n].a, bases[n].b)])
    hi, lo = spread_over_ranks(comm, sums, tag="basis", metered=True)
    apart = (hi != lo).reshape(-1, 2).any(dim=1).tolist()  # one host read
    differ = [n for n, bad in zip(names, apart) if bad]
    if differ:
        comm.broadcast([t for n in differ for t in (bases[n].a, bases[n].b, bases[n].s)], src=0, tag="basis")


def sync_tensors(params: Dict[str, torch.Tensor], bases: Dict[str, Basis], role: str,
                 mode: str) -> Tuple[List[torch.Tensor], Callable[[], None]]:
    """What a world sync averages (buffers aside), and the function that writes their mean back into W.

    ``full``: every W itself (nothing to write back).  ``with-stale`` (the paper's default): each rank's factors
    after its phase, recovered from W by projection, costing ``(m + n) k`` per compressed layer instead of ``m
    n``, and the dense tensors; W becomes mean(A) mean(B) (+ residual).
    """
    if mode == "full" or not bases:
        return list(params.values()), lambda: None
    mats = {n: tall_view(params[n].data)[0] for n in bases}
    factors = {n: b.factors_after(mats[n], role) for n, b in bases.items()}
    dense = [p for n, p in params.items() if n not in bases]

    @torch.no_grad()
    def write() -> None:
        for n, (a, b) in factors.items():
            residual = bases[n].residual
            mats[n].copy_(a @ b if residual is None else a @ b + residual)

    return [t for pair in factors.values() for t in pair] + dense, write


def phase_start_tensors(params: Dict[str, torch.Tensor], bases: Dict[str, Basis], mode: str) -> List[torch.Tensor]:
    """What :func:`sync_tensors` would give at the very start of an AB phase, in its order, exactly: the bases'
    own factors (identical on every rank after :func:`agree`; recovering them by projection would add each
    role's own rounding) and the dense tensors."""
    if mode == "full" or not bases:
        return list(params.values())
    return [t for b in bases.values() for t in (b.a, b.b)] + [p for n, p in params.items() if n not in bases]


def compressible(named: Sequence[Tuple[str, torch.Tensor]], patterns: Sequence[str]) -> List[Tuple[str, torch.Tensor]]:
    """The matrices AB may factorise: every parameter of 2 or more dimensions whose name matches none of the
    ``full_rank`` patterns (fnmatch); ConfigError naming a pattern that matches no parameter at all."""
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named):
            sample = ", ".join(n for n, _ in list(named)[:8])
            raise ConfigError(f"ab.full_rank pattern {pat!r} matches no parameter (fnmatch on names such as {sample})")
    return [(n, p) for n, p in named if p.ndim >= 2 and not any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]


def warn_nothing_compressed(step: int, candidates, config: ABConfig) -> None:
    """AB's first basis kept every layer dense: AB then runs as local SGD with group averaging."""
    if not candidates:
        why = "no parameter is a matrix outside full_rank"
    else:
        why = (f"at rank_cutoff={config.rank_cutoff} no layer's compression reached min_compression_rate="
               f"{config.min_compression_rate} (the weights' singular values have not fallen yet)")
    warnings.warn(
        f"AB: the first basis (step {step}) compresses no layer: {why}. AB then sends full-size tensors "
        "inside its groups (local SGD with group averaging, no compression). Lengthen warmup_steps so the "
        "spectra fall, raise rank_cutoff, or lower min_compression_rate; state.report()['layers'] shows each "
        "layer's rank", stacklevel=user_stacklevel())

