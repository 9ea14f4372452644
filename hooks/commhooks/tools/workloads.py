"""The trainer's two workloads: MNIST-1D classification (quick) and a byte-level GPT on Python source (real).

A workload gives the model, this rank's micro-batches, the loss, the
optimizer's parameter groups and the evaluation; the trainer, the engines
and the hooks are the same for both.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Iterator, List, Tuple, Type

import torch
import torch.nn.functional as F

from .data import load_mnist1d, rank_batches
from .models import GPT, build_model
from .text import eval_windows, load_corpus, text_batches


class MNIST1D:
    """MNIST-1D (4000 train / 1000 test sequences, 10 classes) with the CNN or the MLP; quality: test accuracy."""

    metric = "test_acc"
    # the trainer's defaults where its flags are left unset, and the benchmark's
    defaults = {"batch_size": 32, "lr": 0.003, "clip": 0.0}
    bench_steps = 1200
    config_suffix = "mnist1d"  # the benchmark's method configs: configs/<method>_<suffix>.json
    bf16_on_cuda = False  # --autocast auto

    def __init__(self, args):
        self.args = args
        self.data = load_mnist1d(Path(args.cache_dir), seed=args.data_seed)

    def model(self) -> torch.nn.Module:
        return build_model(self.args.model)

    def batches(self, micro: int, rank: int, world: int, seed: int, start: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for _, idx in rank_batches(len(self.data["y"]), micro, rank, world, seed, start_step=start):
            yield self.data["x"][idx], self.data["y"][idx]

    @staticmethod
    def inputs(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype)  # DeepSpeed's bf16/fp16 engines hold the model in that precision

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), y)

    def param_groups(self, model: torch.nn.Module, weight_decay: float) -> List[Dict]:
        return [{"params": list(model.parameters()), "weight_decay": weight_decay}]

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> Dict[str, float]:
        model.eval()
        dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
        x, y = self.data["x_test"].to(device=device, dtype=dtype), self.data["y_test"].to(device)
        acc = (model(x).float().argmax(1) == y).float().mean().item()
        model.train()
        return {"test_acc": round(acc, 4)}


class Text:
    """A byte-level GPT on twenty standard-library modules (:mod:`commhooks.tools.text`); quality: validation
    loss (nats per byte) and perplexity on the held-out last 10 %.  AdamW decays matrices only."""

    metric = "val_loss"
    # 8 sequences of 64 bytes per rank, nanoGPT-like lr and clipping; 300 steps take minutes on 2 cores
    defaults = {"batch_size": 8, "lr": 0.002, "clip": 1.0}
    bench_steps = 300
    config_suffix = "gpt"
    bf16_on_cuda = True  # on CPUs without bf16 units autocast is ~12x slower: CUDA only by default

    def __init__(self, args):
        self.args = args
        self.corpus = load_corpus()
        self.context = args.context
        self.val = eval_windows(self.corpus["val"], self.context)

    def model(self) -> torch.nn.Module:
        return GPT(context=self.context)

    def batches(self, micro: int, rank: int, world: int, seed: int, start: int) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for _, xy in text_batches(self.corpus["train"], micro, self.context, rank, world, seed, start_step=start):
            yield xy

    @staticmethod
    def inputs(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x  # token ids

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))

    def param_groups(self, model: torch.nn.Module, weight_decay: float) -> List[Dict]:
        """Weight decay on matrices (projections, the tied embedding), none on biases and LayerNorm gains."""
        params = [p for p in model.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> Dict[str, float]:
        model.eval()
        device = next(model.parameters()).device
        x, y = (t.to(device) for t in self.val)
        loss = float(self.loss(model(x), y))
        model.train()
        return {"val_loss": round(loss, 4), "val_ppl": round(math.exp(loss), 3), "corpus_sha256": self.corpus["sha256"]}


WORKLOADS: Dict[str, Type] = {"cnn": MNIST1D, "mlp": MNIST1D, "gpt": Text}  # --model -> workload


def build_workload(args):
    return WORKLOADS[args.model](args)
