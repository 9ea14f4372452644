"""Traffic declarations of the methods commhooks is measured against (:mod:`.anchors`: PyTorch's own DDP hooks).

Not algorithms of ours, so not in the registry; the same :class:`~commhooks.algorithms.traffic.Traffic` as an
algorithm declares, so ``commhooks plan`` treats every method alike.  Per rank and step, ``N`` parameter
elements: DDP (``none``) one allreduce of ``4 N``; ``fp16`` ``2 N``; ``powersgd`` ``4 N`` for its first
``start_iter`` steps, then per matrix the P and Q factors (``(m + n) r``, fp32) where that compresses by at
least 2x (torch's ``min_compression_rate``), every other tensor uncompressed; ``local-sgd`` ``4 N`` for
``start_iter`` steps, then a parameter average of ``4 N`` every ``period`` steps; ``compute-only`` nothing.
FSDP2 sharding a model over a node's ``g`` ranks (``commhooks bench --engine fsdp``): inside the node every step
(:func:`fsdp_traffic`), and for its own HSDP across the nodes (:func:`hsdp_traffic`).
torch's hooks have no commhooks meter: the benchmark's payload counter measures them.
"""

from __future__ import annotations

import math
from typing import List, Tuple

from ..facts import row_shard_numel
from ..algorithms.traffic import Send, Setting, Traffic

DENSE, COMPUTE_ONLY = "none", "compute-only"  # DDP's own allreduce; no communication at all
ENGINES = ("ddp", "fsdp")  # what the methods run on: DDP, or FSDP2 sharding the model over a node's ranks


def powersgd_step_bytes(shapes, rank: int, min_rate: float = 2.0) -> Tuple[int, int, int]:
    """torch's PowerSGD after its start iteration: bytes of (the uncompressed tensors, P, Q)."""
    dense = p = q = 0
    for _, shape in shapes:
        numel = math.prod(shape)
        if len(shape) > 1:
            m, n = shape[0], numel // shape[0]
            r = min(rank, m, n)
            if (m + n) * r * min_rate < m * n:
                p, q = p + 4 * m * r, q + 4 * n * r
                continue
        dense += 4 * numel
    return dense, p, q


def anchor_traffic(method: str, setting: Setting, powersgd_rank: int = 4, local_period: int = 8,
                   start_iter: int = 50) -> Traffic:
    """The traffic of the trainer's ``--hook method`` (``none`` = DDP) for one rank in ``setting``."""
    s, steps = setting, setting.steps
    full = Send("allreduce", 4 * s.numel, "grad")
    timeline: List[Tuple[Send, ...]]
    sync: Tuple[Send, ...] = ()
    sync_steps: List[int] = []
    if method == DENSE:
        timeline = [(full,)] * steps
    elif method == "fp16":
        timeline = [(Send("allreduce", 2 * s.numel, "grad"),)] * steps
    elif method == "powersgd":
        start = min(max(2, start_iter), steps)
        dense, p, q = powersgd_step_bytes(s.shapes, powersgd_rank)
        compressed = tuple(Send("allreduce", b, t) for b, t in ((dense, "grad"), (p, "powersgd-p"), (q, "powersgd-q"))
                           if b)
        timeline = [(full,)] * start + [compressed] * (steps - start)
    elif method == "local-sgd":
        start = min(start_iter, steps)
        timeline = [(full,)] * start + [()] * (steps - start)
        sync = (Send("allreduce", 4 * s.numel, "average"),)
        for i in range(math.ceil((steps - start) / local_period)):
            timeline[start + i * local_period] = sync
            sync_steps.append(start + i * local_period + 1)
    elif method == COMPUTE_ONLY:
        timeline = [()] * steps
    else:
        raise ValueError(f"no traffic declared for --hook {method!r}")
    if s.world == 1:
        timeline = [()] * steps
    return Traffic(list(timeline), timeline[-1] if timeline else (), sync, sync_steps)


def _shard_bytes(s: Setting, names=None) -> int:
    """fp32 bytes of this rank's FSDP2 shard (each parameter's chunk of rows) in a group of the node's ranks, of
    the parameters ``names`` picks (default: all)."""
    g = s.local_world or s.world
    return 4 * row_shard_numel([shape for n, shape in s.shapes if names is None or names(n)], g, s.rank % g)


def fsdp_traffic(setting: Setting, blocks: str = "blocks.") -> Traffic:
    """FSDP2's own traffic inside a replica group of ``setting.local_world`` ranks, every step, each rank's
    contribution in fp32, as the trainer shards (``fully_shard`` on each of the model's ``blocks``, then the root):
    a block's parameters all-gathered for forward and again for backward, the root's once (FSDP2 keeps the
    root's gathered from forward through backward), the gradients reduce-scattered (the whole model; a
    reduce-scatter moves what an all-to-all of the same input moves, so it is declared as one)."""
    s, g = setting, setting.local_world or setting.world
    in_blocks = _shard_bytes(s, lambda n: n.startswith(blocks))
    step = (Send("allgather", in_blocks, "fsdp-gather", "group"),
            Send("allgather", _shard_bytes(s), "fsdp-gather", "group"),
            Send("alltoall", 4 * s.numel, "fsdp-reduce-scatter", "group")) if g > 1 else ()  # one rank: nothing
    return Traffic([step] * s.steps, step, group=g)


def hsdp_traffic(setting: Setting) -> Traffic:
    """FSDP2's own HSDP across the nodes, besides :func:`fsdp_traffic`: every step each rank all-reduces its shard
    of the gradients with the same shard on the other nodes (fp32)."""
    send = (Send("allreduce", _shard_bytes(setting), "grad", "across"),)
    return Traffic([send] * setting.steps, send, group=setting.local_world or setting.world)


LABELS = {DENSE: "DDP", "fp16": "DDP fp16", "powersgd": "PowerSGD", "local-sgd": "post-local SGD",
          COMPUTE_ONLY: "compute only"}


def anchor_label(method: str) -> str:
    """How a table names the baseline ``--hook method``."""
    return LABELS[method]
