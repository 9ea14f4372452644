"""Where a figure came from: the commit that ran it and a hash of the config it ran.

Why (docs/pages/tools/measure.md, "one run, one commit"): DDP's GPT seed-0 loss was 1.3847 in three runs and 1.3760 some
50 commits later, so a table that divides figures of two commits measures the code change as much as the method.
Every summary ``commhooks train`` writes and every row of ``commhooks bench`` carries both, and ``commhooks table``
refuses to put runs of different commits in one table unless asked.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Optional


@functools.lru_cache(maxsize=1)
def commit() -> dict:
    """The commit this package runs from (and whether its package or configs had uncommitted changes), or
    ``None`` for both where the package is not a git checkout (an installed wheel)."""
    where = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        # what decides a figure: the package and the shipped configs (an edited README changes no result);
        # ":/" names them from the top of the checkout, wherever this file sits in it
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/hooks", ":/configs"],
                               cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


@functools.lru_cache(maxsize=1)
def machine() -> dict:
    """The processor a figure was computed on: its model name and the instruction set torch's CPU kernels
    chose (``AVX512``, ``AVX2``, ``DEFAULT``).  Why: the same commit, seed and set-up give bit-identical
    results on one machine and different ones on another.  DDP's GPT seed-0 loss at one clean commit
    (results/ddp-machine-2026-12-07): 1.3760 on an AVX-512 machine's own kernels, 1.3882 with them held to
    AVX2, where the machines of the days before gave 1.3847; the kernels' summation order follows the
    instruction set and 1000 steps amplify it.  A results file that names its processor says which figures
    may be compared bit for bit."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch  # here, not at the top: the rest of this module is read by tools that never train

    return {"model": model, "capability": torch.backends.cpu.get_cpu_capability()}


def config_sha256(config: dict) -> str:
    """16 hex digits of a SHA-256 of the config (keys sorted): two rows with the same one ran the same settings."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def describe(commit: Optional[str], dirty: Optional[bool]) -> str:
    """``commit 0123456``, ``commit 0123456 with uncommitted changes``, or ``commit not recorded``: how a table
    names the code its figures came from."""
    if not commit:
        return "commit not recorded"
    return f"commit {commit[:7]}" + (" with uncommitted changes" if dirty else "")
