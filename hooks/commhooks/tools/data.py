"""MNIST-1D, built offline, cached, and sharded across ranks.

``mnist1d.make_dataset()`` generates the data set from templates (no
download): 4000 training and 1000 test sequences of length 40, 10 classes.
Published test accuracies: logistic regression 32 %, MLP 68 %, CNN 94 %.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterator, Tuple

import torch

def load_mnist1d(cache_dir: Path, seed: int = 42) -> Dict[str, torch.Tensor]:
    """Return ``{"x", "y", "x_test", "y_test"}`` tensors; x is (N, 1, 40) float32.

    The cache holds tensors only and is read with ``weights_only=True``: a cache file that someone else
    put there cannot run code (an older pickle cache, ``.pkl``, is never read).
    """
    cache = Path(cache_dir) / f"mnist1d-seed{seed}.pt"
    if cache.is_file():
        raw = torch.load(cache, map_location="cpu", weights_only=True)
    else:
        from mnist1d.data import get_dataset_args, make_dataset

        args = get_dataset_args()
        args.seed = seed
        made = make_dataset(args)
        raw = {k: torch.as_tensor(made[k], device="cpu") for k in ("x", "y", "x_test", "y_test")}
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        torch.save(raw, tmp)
        os.replace(tmp, cache)  # atomic: ranks may build it at the same time
    out = {}
    for split in ("", "_test"):
        # the data set stays on the CPU: the trainer moves each batch to the model's device
        out["x" + split] = torch.as_tensor(raw["x" + split], dtype=torch.float32, device="cpu").unsqueeze(1)
        out["y" + split] = torch.as_tensor(raw["y" + split], dtype=torch.long, device="cpu")
    return out


def rank_batches(
    n: int, batch_size: int, rank: int, world: int, seed: int, start_step: int = 0
) -> Iterator[Tuple[int, torch.Tensor]]:
    """Endless ``(step, indices)`` for this rank: a fresh permutation per epoch, rank-strided.

    Deterministic in ``(seed, step)``, so a resumed run sees the same batches
    as the uninterrupted one.
    """
    per_rank = n // world
    per_epoch = per_rank // batch_size
    if per_epoch == 0:
        raise ValueError(f"batch_size {batch_size} is larger than the {per_rank} samples of a rank")
    step = start_step
    while True:
        epoch, b = divmod(step, per_epoch)
        g = torch.Generator().manual_seed(seed * 100003 + epoch)
        perm = torch.randperm(n, generator=g, device="cpu")[rank::world][:per_rank]
        yield step, perm[b * batch_size : (b + 1) * batch_size]
        step += 1
