"""Where ``make gpu-check`` runs, and what its tests share: the model, the batches, the record of results."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Optional

import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Target:
    device: str  # "cuda" or, for developing the check itself, "cpu"
    backend: str  # several ranks on one device: "cuda:gloo" (NCCL refuses two ranks on one GPU), or "gloo"
    small: bool  # small sizes (CPU mode)

    @property
    def describe(self) -> str:
        if self.device == "cuda":
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        return f"CPU MODE (COMMHOOKS_GPU_CHECK_ON_CPU=1): the check's logic only, nothing about GPUs, torch {torch.__version__}"


def _target():
    if torch.cuda.is_available():
        return Target("cuda", "cuda:gloo", small=False), ""
    if os.environ.get("COMMHOOKS_GPU_CHECK_ON_CPU") == "1":
        return Target("cpu", "gloo", small=True), ""
    return None, "CUDA is not available here (torch.cuda.is_available() is False): run `make gpu-check` on a GPU host"


TARGET, WHY_SKIPPED = _target()
OUT = Path(os.environ.get("GPU_CHECK_OUT", "results/gpu-check"))


def record(name: str, figures: dict) -> None:
    """Append one check's figures to ``$GPU_CHECK_OUT/gpu-check.jsonl`` (and print them)."""
    OUT.mkdir(parents=True, exist_ok=True)
    row = {"check": name, "when": datetime.datetime.now().isoformat(timespec="seconds"),
           "target": TARGET.describe if TARGET else None, **figures}
    with open(OUT / "gpu-check.jsonl", "a") as fd:
        fd.write(json.dumps(row) + "\n")
    print(f"\n[gpu-check] {name}: {json.dumps(figures)}", flush=True)


def model(dropout: float = 0.0, batchnorm: bool = True) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(12, 32), *([nn.BatchNorm1d(32)] if batchnorm else []), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 3))


def batch(step: int, rank: int, device):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 12, generator=g, device="cpu")
    y = torch.randint(0, 3, (16,), generator=g, device="cpu")
    return x.to(device), y.to(device)


def local_device(rank_on_one_gpu: bool = True) -> torch.device:
    """The rank's device: every rank on cuda:0 (one lent GPU), or the CPU in CPU mode."""
    if TARGET is not None and TARGET.device == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def ddp(module: nn.Module, device: torch.device):
    """DDP as a GPU user builds it (``device_ids``), without re-broadcasting buffers on every forward (both
    torch spellings: the GPU host's torch may be older than this project's)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    module = module.to(device)
    kwargs = {"device_ids": [device]} if device.type == "cuda" else {}
    sig = inspect.signature(DDP.__init__).parameters
    kwargs["forward_sync_buffers" if "forward_sync_buffers" in sig else "broadcast_buffers"] = False
    return DDP(module, **kwargs)


def deterministic() -> None:
    """Bit-exact CUDA runs (same GPU, same shapes): deterministic kernels, no TF32."""
    torch.use_deterministic_algorithms(True)
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # cuBLAS's deterministic mode (set before CUDA starts)


def maybe(value: Optional[float], digits: int = 4):
    return None if value is None else round(value, digits)
