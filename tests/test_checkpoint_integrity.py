"""Checkpoints that say what is wrong with them (issue #52, items 2 and 3), on 2 real gloo ranks.

* A rank file that changed after its commit (8 bytes flipped inside a tensor, the same size) is refused by its
  SHA-256 in the manifest: the load falls back to the newest older checkpoint with a warning on every rank.
* A full disk and a read-only folder (real tmpfs mounts: the suite runs as root, as CI does) fail the save on
  every rank with the cause and the folder named, and leave no temporary file and no rank file behind.
* A manifest without one of the keys every commit writes is a CheckpointError naming the file and the key.
"""

from __future__ import annotations

import contextlib
import struct
import subprocess
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from tests.dist import run_ranks

pytestmark = pytest.mark.xdist_group("checkpoint_integrity")
QSR = {"type": "qsr", "h_base": 2}


def _build(width):
    torch.manual_seed(0)
    net = DDP(torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return net, opt, commhooks.ddp.register(net, opt, dict(QSR))


def _steps(net, opt, start, count, rank):
    for step in range(start, start + count):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


def _flip_inside_a_tensor(path: Path) -> None:
    """8 bytes flipped in the middle of the largest tensor's stored bytes (a zip entry torch stores as is)."""
    with zipfile.ZipFile(path) as archive:
        entry = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[entry.header_offset + 26: entry.header_offset + 30])
    start = entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2
    raw[start: start + 8] = bytes(b ^ 0xFF for b in raw[start: start + 8])
    path.write_bytes(bytes(raw))


def _bit_rot(rank, world, ckdir):
    net, opt, state = _build(16)
    _steps(net, opt, 0, 2, rank)
    commhooks.save_checkpoint(ckdir, net, opt, state)
    _steps(net, opt, 2, 2, rank)
    commhooks.save_checkpoint(ckdir, net, opt, state)
    torch.distributed.barrier()
    if rank == 0:
        _flip_inside_a_tensor(Path(ckdir) / "step-00000004" / "rank1.pt")
    torch.distributed.barrier()
    net2, opt2, state2 = _build(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = commhooks.load_checkpoint(ckdir, net2, opt2, state2)
    return {"step": ck["step"], "warnings": [str(w.message) for w in caught if "skipped" in str(w.message)]}


def test_a_rank_file_changed_after_its_commit_is_refused_by_its_digest(tmp_path):
    for rank, r in enumerate(run_ranks(_bit_rot, 2, timeout=120, ckdir=str(tmp_path))):
        assert r["step"] == 2, r  # step 4's rank-1 file changed: every rank falls back to step 2, and says why
        assert len(r["warnings"]) == 1 and "step-00000004" in r["warnings"][0], r["warnings"]
        assert "rank(s) [1]" in r["warnings"][0] and ("SHA-256" in r["warnings"][0]) == (rank == 1), r["warnings"]


@contextlib.contextmanager
def _tmpfs(where: Path, size: str, read_only: bool = False):
    """A real filesystem of ``size`` at ``where`` (root, as CI runs; without it the test fails, it never skips)."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        (where / "ckpt").mkdir()
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where / "ckpt"
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _save_where_it_cannot(rank, world, ckdir):
    net, opt, state = _build(256)  # two rank files of about 20 kB each (parameters and momentum)
    _steps(net, opt, 0, 2, rank)
    try:
        commhooks.save_checkpoint(ckdir, net, opt, state)
        return {"error": None}
    except commhooks.CheckpointError as exc:
        return {"error": str(exc), "left": sorted(str(p) for p in Path(ckdir).rglob("*") if p.is_file())}


@pytest.mark.parametrize("case", ["full", "read-only"])
def test_a_full_disk_or_a_read_only_folder_is_named_on_every_rank(tmp_path, case):
    with _tmpfs(tmp_path / "mnt", "24k" if case == "full" else "1m", read_only=case == "read-only") as ckdir:
        results = run_ranks(_save_where_it_cannot, 2, timeout=120, ckdir=str(ckdir))
        left = sorted(str(p) for p in ckdir.rglob("*") if p.is_file())
    cause = "no space left on the device" if case == "full" else "a read-only filesystem"
    for r in results:
        assert r["error"] and "was not written by rank(s)" in r["error"] and cause in r["error"], r
        assert str(ckdir) in r["error"], r["error"]
    assert left == [], left  # no temporary file, no rank file of a checkpoint nobody committed


def _malformed(rank, world, ckdir):
    net, opt, state = _build(16)
    _steps(net, opt, 0, 2, rank)
    folder = commhooks.save_checkpoint(ckdir, net, opt, state)
    torch.distributed.barrier()
    if rank == 0:
        manifest = folder / "manifest.json"
        manifest.write_text(manifest.read_text().replace('"step"', '"stpe"'))
    torch.distributed.barrier()
    try:
        commhooks.load_checkpoint(ckdir, *_build(16))
        return None
    except commhooks.CheckpointError as exc:
        return str(exc)


def test_a_manifest_without_a_key_is_a_checkpoint_error_naming_the_file_and_the_key(tmp_path):
    for error in run_ranks(_malformed, 2, timeout=120, ckdir=str(tmp_path)):
        assert error and "manifest.json" in error and "'step'" in error, error
