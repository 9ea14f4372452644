"""A small text corpus that is on every machine offline: twenty modules of Python's own standard library.

Byte-level (vocabulary 256, no tokenizer to install): the files below, read
in this order from the running interpreter's ``stdlib`` directory, joined by
a NUL byte.  The first 90 % of the bytes train, the last 10 % validate.
``corpus_sha256`` identifies the text: runs compare across machines only
when it matches (it does for the same Python release; CPython 3.11.7 gives
:data:`SHA256_311`).  About 0.94 MB; a model of a few million parameters
learns its syntax and identifiers in a few hundred steps.
"""

from __future__ import annotations

import hashlib
import sysconfig
import warnings
from pathlib import Path
from typing import Dict, Iterator, Tuple

import torch

FILES = (
    "argparse.py", "collections/__init__.py", "json/decoder.py", "json/encoder.py", "textwrap.py", "difflib.py",
    "fractions.py", "heapq.py", "statistics.py", "dataclasses.py", "functools.py", "shlex.py", "string.py",
    "tokenize.py", "enum.py", "inspect.py", "pathlib.py", "typing.py", "csv.py", "calendar.py",
)
SHA256_311 = "17a8c9555e6ad5f5cb87689a3a5a8c41c0492e882f4a4ecb33703a2c9751da65"  # CPython 3.11.7
VAL_FRACTION = 0.1


def load_corpus(stdlib: str | None = None) -> Dict[str, object]:
    """``{"train", "val"}`` as uint8 tensors, ``"sha256"`` of the joined text, ``"files"``."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    missing = [f for f in FILES if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"the GPT corpus needs these standard-library files under {root}: {missing}")
    text = b"\0".join((root / f).read_bytes() for f in FILES)
    digest = hashlib.sha256(text).hexdigest()
    if digest != SHA256_311:
        warnings.warn(f"the GPT corpus from {root} has sha256 {digest[:12]}..., not CPython 3.11.7's "
                      f"{SHA256_311[:12]}...: losses will not compare with runs made there", stacklevel=2)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    cut = int(len(data) * (1 - VAL_FRACTION))
    return {"train": data[:cut].clone(), "val": data[cut:].clone(), "sha256": digest, "files": FILES}


def text_batches(data: torch.Tensor, batch_size: int, context: int, rank: int, world: int, seed: int,
                 start_step: int = 0) -> Iterator[Tuple[int, Tuple[torch.Tensor, torch.Tensor]]]:
    """Endless ``(step, (x, y))`` for this rank: ``batch_size`` random windows of ``context`` bytes and the
    bytes that follow them.  Deterministic in ``(seed, step, rank)``: a resumed run sees the same batches."""
    step = start_step
    while True:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1009 + rank)
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g, device="cpu")
        windows = torch.stack([data[s: s + context + 1] for s in starts.tolist()]).long()
        yield step, (windows[:, :-1], windows[:, 1:])
        step += 1


def eval_windows(data: torch.Tensor, context: int, limit: int = 64) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` non-overlapping windows of ``data`` (the same on every machine): validation."""
    n = min(limit, (len(data) - 1) // context)
    x = torch.stack([data[i * context: (i + 1) * context] for i in range(n)]).long()
    y = torch.stack([data[i * context + 1: (i + 1) * context + 1] for i in range(n)]).long()
    return x, y
