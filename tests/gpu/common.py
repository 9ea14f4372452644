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
    backend: str  # "nccl" (several ranks on the one GPU: nccl_one_gpu_env), or "gloo" in CPU mode
    small: bool  # small sizes (CPU mode)

    @property
    def device_id(self):
        """What each rank hands to ``init_process_group(device_id=)``: eager NCCL, as
        ``commhooks.launch.init_distributed`` starts it (subgroups are then split from the world's
        communicator); None in CPU mode."""
        return "cuda:0" if self.device == "cuda" else None

    @property
    def describe(self) -> str:
        if self.device == "cuda":
            return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
        return f"CPU MODE (COMMHOOKS_GPU_CHECK_ON_CPU=1): the check's logic only, nothing about GPUs, torch {torch.__version__}"


def _target():
    if torch.cuda.is_available():
        return Target("cuda", "nccl", small=False), ""
    if os.environ.get("COMMHOOKS_GPU_CHECK_ON_CPU") == "1":
        return Target("cpu", "gloo", small=True), ""
    return None, "CUDA is not available here (torch.cuda.is_available() is False): run `make gpu-check` on a GPU host"


TARGET, WHY_SKIPPED = _target()


def nccl_one_gpu_env(rank: int) -> dict:
    """NCCL with several ranks on one GPU.  NCCL refuses two ranks on one device of one host ("Duplicate GPU
    detected": same bus id and same host hash), so each rank claims a host of its own (``NCCL_HOSTID``, which
    NCCL hashes instead of the host name and boot id).  The ranks then look like nodes to NCCL, and it would
    reach for inter-node transports that one machine cannot give two "nodes": InfiniBand, and the NVLink
    fabric (NVLS, MNNVL), and it must not try shared memory or peer-to-peer between them.  What is left is its
    socket transport over the loopback interface: slow, and the same code paths (collectives, ``ReduceOp.AVG``,
    all-to-all, communicator splits, the watchdog) that a multi-node job runs.  Every variable here is one
    that NCCL reads: tests/oldest_torch/test_nccl_recipe.py finds each name in the NCCL library of the oldest
    torch (the GPU host's), on the CPU side."""
    return {"NCCL_HOSTID": f"commhooks-gpu-check-rank{rank}", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
            "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo", "NCCL_NVLS_ENABLE": "0",
            "NCCL_MNNVL_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0"}


def rank_env(rank: int) -> dict:
    """Each rank's environment for a multi-rank check: the one-GPU NCCL recipe and cuBLAS's deterministic mode
    on CUDA, nothing in CPU mode."""
    if TARGET is None or TARGET.device != "cuda":
        return {}
    return {**nccl_one_gpu_env(rank), **ENV}


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


def local_device() -> torch.device:
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


def params_cpu(module: nn.Module) -> dict:
    return {n: p.detach().to("cpu", copy=True).float() for n, p in module.named_parameters()}


def compare_to_cpu(name: str, got: dict, want: dict, start: dict, tolerance: "Tolerance") -> dict:
    """Compare a device run's parameters (``got``) with the same run on the CPU (``want``), tensor by tensor
    (a wrong bias update hides in a whole-model figure: a 10-step run moves biases by 0.006-0.03).  Returns the
    worst figures; raises AssertionError naming the tensor that misses ``tolerance``."""
    worst_abs, worst_rel = 0.0, 0.0
    for n, w in want.items():
        diff = (got[n] - w).abs()
        moved = (w - start[n]).abs().mean().item()
        assert moved > 0, (name, n, "the CPU run did not move this tensor: the comparison would prove nothing")
        worst_abs = max(worst_abs, diff.max().item())
        rel = diff.mean().item() / moved
        worst_rel = max(worst_rel, rel)
        if tolerance.max_abs is not None:
            assert diff.max().item() <= tolerance.max_abs, (name, n, diff.max().item(), tolerance)
        if tolerance.mean_rel is not None:
            assert rel <= tolerance.mean_rel, (name, n, rel, tolerance)
    return {"max_abs_diff_vs_cpu": worst_abs, "mean_diff_over_mean_change": round(worst_rel, 6),
            "tolerance": dataclasses.asdict(tolerance)}


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How close a device run must end to its CPU run, per parameter tensor.

    ``max_abs``: every element within it (fp32 arithmetic: the GPU's kernels sum in another order, which
    10 steps amplify to about 1e-6).  ``mean_rel``: the tensor's mean |difference| at most this fraction of
    its mean |change| over the run: for payloads and bases that can round one element differently on the
    GPU (one int8 code is 1/127 of a block's range; one int2 code a third of it), where a single flip is
    legitimate and a systematic error is not.  Set from that reasoning before any GPU run; the figures each
    GPU run measures are recorded beside them."""

    max_abs: Optional[float] = None
    mean_rel: Optional[float] = None


FP32 = Tolerance(max_abs=1e-5)
INT8 = Tolerance(mean_rel=0.02)
INT2 = Tolerance(mean_rel=0.05)
LOWRANK = Tolerance(mean_rel=0.02)
