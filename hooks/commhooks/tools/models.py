"""Example models for MNIST-1D (input: (N, 1, 40))."""

from __future__ import annotations

import torch
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


MODELS = {"cnn": CNN1D, "mlp": MLP}


def build_model(name: str) -> nn.Module:
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    return MODELS[name]()
