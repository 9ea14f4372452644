"""Example models: for MNIST-1D (input: (N, 1, 40)) and a small GPT for byte-level text."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CNN1D(nn.Module):
    """Three 1-D convolutions and two linear layers, ~185k parameters.

    The 640x256 linear layer holds most weights, as the classifier head of
    VGG-like nets does, so low-rank compression has something to find.
    """

    def __init__(self, channels: int = 32, hidden: int = 256, classes: int = 10, length: int = 40):
        super().__init__()
        c = channels
        self.features = nn.Sequential(
            nn.Conv1d(1, c, 5, padding=2), nn.ReLU(),
            nn.Conv1d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv1d(2 * c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * c * (length // 4), hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class MLP(nn.Module):
    """Two wide hidden layers: the case where low rank matters most."""

    def __init__(self, hidden: int = 512, classes: int = 10, length: int = 40):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(length, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal multi-head self-attention, then a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-style causal language model over bytes: token and position embeddings, pre-LN blocks, a final
    LayerNorm, and an output head tied to the token embedding.  Default: 3 blocks of width 256, 4 heads,
    context 64, ~2.4 M parameters (a few hundred steps on two CPU cores take minutes).

    The projection matrices (256 x 768, 1024 x 256, ...) are where AB finds low rank; the tied embedding
    (256 x 256) is shared by input and output."""

    def __init__(self, vocab: int = 256, dim: int = 256, layers: int = 3, heads: int = 4, context: int = 64):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        for name, p in self.named_parameters():  # GPT-2's initialisation, residual projections scaled down
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        x = self.ln(self.blocks(x))
        return x @ self.tok.weight.t()  # tied head: logits over the vocabulary


MODELS = {"cnn": CNN1D, "mlp": MLP, "gpt": GPT}


def build_model(name: str) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    return MODELS[name]()
