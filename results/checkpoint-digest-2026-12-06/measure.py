"""What the manifest's SHA-256 costs per GB (issue #52): one rank file of 512 MiB of fp32 written as a commit
writes it (atomic_save: a temporary file, fsync, a rename) and digested as the commit and the load do
(file_digest, read back from the page cache).  Run: PYTHONPATH=hooks python results/checkpoint-digest-2026-12-06/measure.py"""

import pathlib
import tempfile
import time

import torch

from commhooks.commit import atomic_save, file_digest

folder = pathlib.Path(tempfile.mkdtemp())
path = folder / "rank0.pt"
tensors = {"w": torch.randn(128 * 1024 * 1024)}  # 512 MiB
for repeat in range(5):
    started = time.perf_counter()
    atomic_save(tensors, path)
    saved = time.perf_counter() - started
    started = time.perf_counter()
    file_digest(path)
    digested = time.perf_counter() - started
    gb = path.stat().st_size / 1e9
    print(f"repeat {repeat}: {gb:.3f} GB, save {saved / gb:.2f} s/GB, digest {digested / gb:.2f} s/GB")
path.unlink()
folder.rmdir()
