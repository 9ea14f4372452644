"""Low-rank bases for AB-training: which weights, which rank, and the W-space projections.

A weight W (ndim >= 2) is seen as a matrix: a conv kernel (C_out, C_in, kh, kw) as C_out x (C_in*kh*kw), transposed
when needed so it is tall (m >= n).  Its SVD ``W = U S Vh`` gives the factors ``A = U sqrt(S)`` (m x k) and ``B =
sqrt(S) Vh`` (k x n), keeping the k components with ``S_i > rank_cutoff * S_0`` (paper: 0.15).

Training A with B frozen is, in W-space, replacing the gradient G by ``(G B^T) B``; training B with A frozen, by ``A
(A^T G)``.  Only the small middle factor (m x k, or k x n) crosses the network.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch


def tall_view(w: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """``w`` as a 2-D view that is tall (m >= n), and whether it was transposed.

    Writes through the view change ``w`` (it is a view, not a copy).
    """
    mat = w.reshape(w.shape[0], -1)
    if mat.shape[0] < mat.shape[1]:
        return mat.t(), True
    return mat, False


def rank_of(s: torch.Tensor, cutoff: float) -> torch.Tensor:
    """:func:`choose_rank` as a 0-d float64 tensor on ``s``'s device (no host read)."""
    if s.numel() == 0:
        return torch.ones((), dtype=torch.float64, device=s.device)
    return torch.clamp((s > cutoff * s[0]).sum(), min=1).to(torch.float64)


def choose_rank(s: torch.Tensor, cutoff: float) -> int:
    """1 + the last index with ``s_i > cutoff * s_0`` (at least 1); ``s`` sorted descending."""
    return int(rank_of(s, cutoff).item())


def compression_ratio(m: int, n: int, k: int) -> float:
    """Parameters of the dense matrix over those of its factors: m n / ((m + n) k)."""
    return (m * n) / ((m + n) * k)


@dataclasses.dataclass
class Basis:
    """The frozen factors of one weight for one AB phase.

    ``s`` holds the k kept singular values (``A^T A = B B^T = diag(s)``, used for the pseudo-inverses);
    ``residual`` is ``W - A B`` when the dropped components stay in the model (first phase with
    ``truncate_first=False``), else ``None``.
    """

    a: torch.Tensor  # m x k
    b: torch.Tensor  # k x n
    s: torch.Tensor  # k
    residual: Optional[torch.Tensor] = None

    @property
    def rank(self) -> int:
        return self.s.numel()

    def dense(self) -> torch.Tensor:
        w = self.a @ self.b
        return w if self.residual is None else w + self.residual

    # --- W-space gradient projections (A-rank / B-rank) --------------------
    def a_payload(self, g: torch.Tensor) -> torch.Tensor:
        """What an A-rank sends: dL/dA = G B^T (m x k)."""
        return g @ self.b.t()

    def a_update(self, payload: torch.Tensor) -> torch.Tensor:
        """The W-space gradient of an A-rank: (mean dL/dA) B."""
        return payload @ self.b

    def b_payload(self, g: torch.Tensor) -> torch.Tensor:
        """What a B-rank sends: dL/dB = A^T G (k x n)."""
        return self.a.t() @ g

    def b_update(self, payload: torch.Tensor) -> torch.Tensor:
        return self.a @ payload

    def payload(self, g: torch.Tensor, role: str) -> torch.Tensor:
        """What a rank of ``role`` ("A" or "B") sends for the W-space gradient ``g``."""
        return self.a_payload(g) if role == "A" else self.b_payload(g)

    def update(self, payload: torch.Tensor, role: str) -> torch.Tensor:
        """The W-space gradient of a rank of ``role`` from its (averaged) payload."""
        return self.a_update(payload) if role == "A" else self.b_update(payload)

    # --- factor recovery for the with-stale sync --------------------------
    def factors_after(self, w: torch.Tensor, role: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) after its phase, recovered from W by projection.

        An A-rank moved only A: ``A' = A + (W - W0) B^+`` with ``B^+ = B^T diag(1/s)``; a B-rank moved only
        B: ``B' = B + A^+ (W - W0)`` with ``A^+ = diag(1/s) A^T``.
        """
        delta = w - self.dense()
        if role == "A":
            return self.a + (delta @ self.b.t()) / self.s, self.b.clone()
        return self.a.clone(), self.b + (self.a.t() @ delta) / self.s[:, None]


def svd(w: torch.Tensor):
    """Thin SVD of a tall matrix, in float32 at least (half-precision SVD is not supported by torch)."""
    work = w.float() if w.dtype in (torch.float16, torch.bfloat16) else w
    return torch.linalg.svd(work, full_matrices=False)


def basis_from_svd(u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor, k: int, dtype: torch.dtype) -> Basis:
    """``A = U_k sqrt(S_k)``, ``B = sqrt(S_k) Vh_k``, in the weight's dtype."""
    root = s[:k].sqrt()
    return Basis(a=(u[:, :k] * root).to(dtype), b=(root[:, None] * vh[:k]).to(dtype), s=s[:k].to(dtype))


def layer_compression(params, ranks) -> Tuple[List[dict], int, int]:
    """Per layer of ``params`` (name -> tensor) at ``ranks`` (name -> rank, None or absent: dense): name, shape,
    rank and compression; and the parameters of the dense model and of the factorised one (their ratio is the
    paper's headline metric, 44.14:1 for VGG16)."""
    layers, stored, total = [], 0, 0
    for name, p in params.items():
        total += p.numel()
        k = ranks.get(name)
        if k is None:
            stored += p.numel()
            if p.ndim >= 2:
                layers.append({"name": name, "shape": list(p.shape), "rank": None, "compression": 1.0})
            continue
        m, n = tall_view(p.data)[0].shape
        stored += (m + n) * k
        layers.append({"name": name, "shape": list(p.shape), "rank": k,
                       "compression": round(compression_ratio(m, n, k), 2)})
    return layers, total, stored


def format_layers(report: dict) -> List[str]:
    """The layer table and the overall compression of an AB ``report()``, as lines."""
    lines = []
    for layer in report["layers"]:
        k = "dense" if layer["rank"] is None else f"rank {layer['rank']}"
        lines.append(f"  {layer['name']:<28} {str(tuple(layer['shape'])):<18} {k:<10} {layer['compression']:>7.2f}:1")
    lines.append(f"  parameter compression {report['compression']:.2f}:1 ({report['params_dense']} -> "
                 f"{report['params_factored']} parameters: the factors' size, the paper's metric, not the traffic)")
    return lines

