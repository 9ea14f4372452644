"""Traffic declarations of the methods commhooks is measured against (:mod:`.anchors`: PyTorch's own DDP hooks).

Not algorithms of ours, so not in the registry; the same :class:`~commhooks.algorithms.traffic.Traffic` as an
algorithm declares, so ``commhooks plan`` treats every method alike.  Per rank and step, ``N`` parameter
elements: DDP (``none``) one allreduce of ``4 N``; ``fp16`` ``2 N``; ``powersgd`` ``4 N`` for its first
``start_iter`` steps, then per matrix the P and Q factors (``(m + n) r``, fp32) where that compresses by at
least 2x (torch's ``min_compression_rate``), every other tensor uncompressed; ``local-sgd`` ``4 N`` for
``start_iter`` steps, then a parameter average of ``4 N`` every ``period`` steps; ``compute-only`` nothing.
torch's hooks have no commhooks meter: the benchmark's payload counter measures them.
"""

from __future__ import annotations

import math
from typing import List, Tuple

from ..algorithms.traffic import Send, Setting, Traffic

DENSE, COMPUTE_ONLY = "none", "compute-only"  # DDP's own allreduce; no communication at all


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


LABELS = {DENSE: "DDP", "fp16": "DDP fp16", "powersgd": "PowerSGD", "local-sgd": "post-local SGD",
          COMPUTE_ONLY: "compute only"}


def anchor_label(method: str) -> str:
    """How a table names the baseline ``--hook method``."""
    return LABELS[method]
