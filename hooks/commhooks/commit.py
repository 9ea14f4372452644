"""How the ranks agree on a checkpoint and commit it: the one story every way of saving a hooked run tells.

A hooked run is saved four ways: per-rank files (:mod:`commhooks.checkpoint`), the same files written on a
schedule off the training thread (:mod:`commhooks.checkpointer`), FSDP2's DCP folders
(:mod:`commhooks.fsdp.checkpoint`) and DeepSpeed's (:mod:`commhooks.deepspeed.checkpoint`).  Their files differ;
what must not differ is how the ranks decide together, because a rank that decides alone either waits forever
for the others or leaves a checkpoint that names files nobody wrote.  So it is written once, here:

* :class:`CommitGroup` is the ranks that decide together, built from the hook state and the model: its
  ``device`` (the hook's, else the model's: an NCCL group refuses CPU tensors), ``rank`` and ``world``, one
  elementwise max over the ranks read on the host (:meth:`~CommitGroup.allreduce_max`, through the hook's Comm
  when there is one, unmetered), and what is decided with it: before a save, every rank at the same step with
  no NaN/Inf since its last sync (:meth:`~CommitGroup.agree_to_save`); at a load, which ranks failed
  (:meth:`~CommitGroup.ranks_where`); and the commit of per-rank files (:meth:`~CommitGroup.commit`).
* The commit of per-rank files (``<dir>/step-00000400/rank<r>.pt``, ``manifest.json``, ``<dir>/latest``):
  each rank writes its file durably (:func:`atomic_save`: a temporary name, ``fsync``, a rename, the folder's
  entry forced to disk), the ranks exchange the files' sizes read on the host (a barrier alone does not hold
  the host under NCCL), rank 0 waits until it sees every file at its size, then writes the manifest and only
  then ``latest`` (:func:`durable_write`) and removes old checkpoints; if it cannot, every rank raises the same
  :class:`CheckpointError`.  :func:`complete_folders` and :func:`latest_checkpoint` read that layout back.

DCP and DeepSpeed commit their own folders (DCP writes ``.metadata`` last, DeepSpeed its ``latest``); FSDP agrees
before its save here, DeepSpeed writes its per-rank hook files with :func:`atomic_save` and agrees on its load
here.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ._version import __version__
from .algorithms.contract.checks import DivergenceError

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: missing, incomplete, unreadable, or from another world size."""


# ------------------------------------------------------------------ the layout


def step_folder(directory, step: int) -> Path:
    """The folder of checkpoint ``step`` under ``directory`` (``step-00000400``)."""
    return Path(directory) / f"step-{step:08d}"


MANIFEST_KEYS = ("step", "world_size", "sizes")  # what every manifest holds (since 2026-12-02; "sha256" since #52)


def read_manifest(folder: Path) -> Optional[dict]:
    """The folder's manifest, or None when it has none (or one that is no JSON: then the folder is not complete).
    A manifest that lacks a key every commit writes is a :class:`CheckpointError` naming the file and the key."""
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    missing = [k for k in MANIFEST_KEYS if not isinstance(manifest, dict) or k not in manifest]
    if missing:
        raise CheckpointError(f"{path} is no commhooks manifest: it has no {missing[0]!r} key (every commit writes "
                              f"{', '.join(MANIFEST_KEYS)}); remove the folder or restore the file")
    return manifest


def complete_folders(root: Path) -> List[Path]:
    """Folders with a manifest, newest step first (each manifest read once)."""
    steps = {p: m["step"] for p in root.glob("step-*") if p.is_dir() and (m := read_manifest(p)) is not None}
    return sorted(steps, key=steps.get, reverse=True)


def latest_checkpoint(directory) -> Optional[Path]:
    """The newest complete checkpoint folder: the one ``latest`` names if it is complete, else the newest
    folder with a manifest; None if there is none."""
    root = Path(directory)
    pointer = root / LATEST
    if pointer.is_file():
        folder = root / pointer.read_text().strip()
        if folder.is_dir() and read_manifest(folder) is not None:
            return folder
    complete = complete_folders(root) if root.is_dir() else []
    return complete[0] if complete else None


def just_synced(state, step: int) -> bool:
    """Whether the hook synced right after ``step`` (every rank then holds the same model): recorded with a
    checkpoint, it lets one load on another number of ranks."""
    return bool(state is not None and hasattr(state, "in_sync_at") and state.in_sync_at() == step)


# ------------------------------------------------------------------ durable files


def _fsync_dir(folder: Path) -> None:
    """Force a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class WriteError(OSError):
    """A file could not be written; ``cause`` says why in words a user acts on (:data:`WRITE_CAUSES`)."""

    def __init__(self, cause: int, message: str):
        super().__init__(message)
        self.cause = cause


# why a write failed, by the code the ranks exchange (0: it did not), in words that name what to do
WRITE_CAUSES = {1: "no space left on the device", 2: "a read-only filesystem", 3: "no permission to write there",
                4: "an error writing the file"}


def write_cause(exc: BaseException, folder: Path) -> int:
    """The :data:`WRITE_CAUSES` code of ``exc``, raised while writing in ``folder``.  torch's writer reports a full
    disk as ``unexpected pos``, without the errno: the disk's free space (read before the partial file goes) says
    it then."""
    code = getattr(exc, "errno", None)
    if code == errno.ENOSPC:
        return 1
    if code == errno.EROFS:
        return 2
    if code in (errno.EACCES, errno.EPERM):
        return 3
    with contextlib.suppress(OSError):
        if shutil.disk_usage(folder).free < (1 << 20):
            return 1
    return 4


def durable_write(path: Path, write) -> int:
    """``write(file)`` to a temporary name, force it to disk, rename it to ``path``, force the folder entry:
    a reader sees the whole file or none.  Returns the file's size.  On a failure the temporary file is removed
    (a full disk stays no fuller) and :class:`WriteError` names the cause and the folder."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fd:
            write(fd)
            fd.flush()
            os.fsync(fd.fileno())
            size = fd.tell()
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001 - any failure: named, and nothing left behind
        cause = write_cause(exc, path.parent)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise WriteError(cause, f"{WRITE_CAUSES[cause]} writing {path} ({type(exc).__name__}: {exc})") from exc
    _fsync_dir(path.parent)
    return size


def file_digest(path: Path) -> str:
    """The SHA-256 of a file, hex (read in 16 MiB pieces).  A rank's digest goes into the manifest when it is
    committed (:func:`digested_save` hashes the file on its way to the disk) and is checked at the load: a file
    changed since (bit rot, a copy cut short at the same size) is refused like a missing one."""
    digest = hashlib.sha256()
    with open(path, "rb") as fd:
        for piece in iter(lambda: fd.read(1 << 24), b""):
            digest.update(piece)
    return digest.hexdigest()


def atomic_save(obj, path: Path) -> int:
    """``torch.save(obj)`` to ``path`` by :func:`durable_write`; returns the file's size."""
    return durable_write(path, lambda fd: torch.save(obj, fd))


class _Digesting:
    """A file torch.save writes through, hashing what it writes (no second read of the file)."""

    def __init__(self, fd):
        self.fd, self.sha256 = fd, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.fd.write(data)

    def flush(self) -> None:
        self.fd.flush()


def digested_save(obj, path: Path) -> Tuple[int, str]:
    """:func:`atomic_save` that also gives the SHA-256 of what it wrote (hashed on the way to the disk)."""
    out = []

    def write(fd) -> None:
        through = _Digesting(fd)
        torch.save(obj, through)
        out.append(through.sha256.hexdigest())

    return durable_write(path, write), out[0]


def _wait_until_visible(folder: Path, sizes: List[int], timeout_s: float) -> str:
    """Poll until ``folder`` shows every rank's file at the size it wrote; "" then, else what is missing."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = []
        for r, size in enumerate(sizes):
            path = folder / f"rank{r}.pt"
            try:
                seen = path.stat().st_size
            except OSError:
                seen = None
            if seen != size:
                missing.append(f"{path} ({'absent' if seen is None else f'{seen} bytes'}, rank {r} wrote {size})")
        if not missing or time.monotonic() > deadline:
            return "; ".join(missing)
        time.sleep(0.05)


# ------------------------------------------------------------------ the ranks that decide together


class CommitGroup:
    """The ranks that agree on a checkpoint and commit it together, built from the hook ``state`` and ``model``.

    ``device``: where the agreement tensors go (the hook's device, else the model's: an NCCL group refuses CPU
    tensors); ``rank`` and ``world``: the hook Comm's (not a live one's: those of the replica group inside it),
    else torch.distributed's, else 0 and 1; ``timeout_s``: the
    collective timeout the other ranks wait with while rank 0 commits (the hook Comm's; None: none known).  Its
    collectives go through the hook's Comm (unmetered: a checkpoint is not the algorithm's traffic), else the
    default process group; :meth:`over` makes one that talks over a gloo group of its own (the Checkpointer's
    writer thread, whose collectives must not interleave with training's).
    """

    def __init__(self, state=None, model=None):
        self.state = state
        self._comm = comm = getattr(state, "comm", None) if state is not None else None
        if comm is not None and not getattr(comm, "fixed_world", True):
            # live replica groups (commhooks.torchft): the hook's Comm spans the groups, which come and go; a
            # group's checkpoint is its own ranks' (torch.distributed's group inside it, or one process)
            self._comm = comm = None
        if comm is not None:
            self.device = comm.device
            self.rank, self.world = comm.rank, comm.size
        else:
            module = getattr(model, "module", model)
            self.device = next((p.device for p in module.parameters()), torch.device("cpu")) \
                if module is not None else torch.device("cpu")
            if dist.is_available() and dist.is_initialized():
                self.rank, self.world = dist.get_rank(), dist.get_world_size()
            else:
                self.rank, self.world = 0, 1
        self.timeout_s = getattr(comm, "timeout_s", None)
        self.process_group = None

    def over(self, process_group, timeout_s: float) -> "CommitGroup":
        """The same ranks talking over ``process_group`` (a gloo group: the agreement tensors on the CPU) whose
        collectives wait ``timeout_s``."""
        other = copy.copy(self)
        other.process_group, other.device, other.timeout_s = process_group, torch.device("cpu"), timeout_s
        return other

    def allreduce_max(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise max over the ranks, in place; the caller's read of the result (on the host) returns only
        once every rank has contributed."""
        if self.world == 1:
            return values
        if self.process_group is not None:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.process_group)
        elif self._comm is not None:
            self._comm.allreduce([values], op="max", tag="checkpoint", metered=False)
        else:
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return values

    def ranks_where(self, flag: bool) -> List[int]:
        """The ranks whose ``flag`` is true (one allreduce): the same list on every rank, so every rank makes the
        same decision (all loaded, or all raise naming the same ranks)."""
        flags = [0.0] * self.world
        flags[self.rank] = 1.0 if flag else 0.0
        flags = self.allreduce_max(torch.tensor(flags, dtype=torch.float64, device=self.device)).tolist()
        return [r for r in range(self.world) if flags[r]]

    def commit_wait_s(self, commit_timeout_s: float) -> float:
        """How long rank 0 may look for the files: ``commit_timeout_s``, but at most half the collective timeout
        the other ranks wait with meanwhile (gloo's raises), so they never give up on a commit rank 0 makes."""
        return commit_timeout_s if not self.timeout_s else min(commit_timeout_s, self.timeout_s / 2)

    def agree_to_save(self, step: int, who: str = "save_checkpoint") -> None:
        """Before anything is written: every rank at the same ``step`` (else DivergenceError on every rank) and no
        rank with a NaN/Inf gradient since its last sync (else NonFiniteError on every rank, counting those
        ranks: a flag per rank in the same max).  One allreduce."""
        state = self.state
        flags = [0.0] * self.world
        flags[self.rank] = float(bool(state is not None and hasattr(state, "alignment")
                                      and state.alignment.guard.seen() is not None))
        spread = self.allreduce_max(torch.tensor([float(step), -float(step), *flags], dtype=torch.float64,
                                                 device=self.device)).tolist()
        high, low, bad = int(spread[0]), -int(spread[1]), int(sum(spread[2:]))
        if bad:  # (only a state with the guard sets a flag, and every rank has the same kind of state)
            state.sync_context.raise_nonfinite(bad, f"checkpoint after optimizer step {step} ({who}: the weights may "
                                                    "hold it; nothing was written)")
        if high != low:
            raise DivergenceError(
                f"{who}: the ranks are at different steps (from {low} to {high}; this rank {self.rank} at {step}): "
                "call it at the same point of the loop on every rank; nothing was written")

    def _files_on_every_rank(self, size: Optional[int], digest: str, cause: int) -> Tuple[List[int], List[str], dict]:
        """Every rank's file size and SHA-256 (``cause``: why this rank could not write, :data:`WRITE_CAUSES`),
        read on the host: returns only once every rank has written its file (or failed to).  The digest travels
        as 11 words of 24 bits (exact in float64).  Returns (sizes, digests, {failed rank: cause})."""
        world, rank, words = self.world, self.rank, 11
        values = torch.zeros((2 + words) * world, dtype=torch.float64, device=self.device)
        values[rank] = float(size or 0)
        values[world + rank] = float(cause)
        if digest:
            number = int(digest, 16)
            for i in range(words):
                values[2 * world + rank * words + i] = float((number >> (24 * i)) & 0xFFFFFF)
        values = [int(v) for v in self.allreduce_max(values).tolist()]
        digests = [format(sum(values[2 * world + r * words + i] << (24 * i) for i in range(words)), "064x")
                   for r in range(world)]
        return values[:world], digests, {r: values[world + r] for r in range(world) if values[world + r]}

    def commit(self, directory, step: int, contents: dict, keep: int, commit_timeout_s: float,
               on_event=None) -> Path:
        """Write this rank's file of checkpoint ``step`` durably, then commit the checkpoint; collective.

        ``contents`` is this rank's file (its ``"synced"`` goes into the manifest).  Rank 0 waits
        :meth:`commit_wait_s` for every rank's file to show, then writes ``manifest.json`` and ``latest`` and
        keeps ``keep`` complete checkpoints (all if ``keep`` <= 0).  A rank that cannot write, or a commit rank 0
        gives up on, raises the same :class:`CheckpointError` on every rank (``commit_timeout_s`` is named in it).
        ``on_event(name, step)``, if given, is told ``"writing"`` before this rank's file is written and
        ``"written"`` once it is durable.  Returns the folder.
        """
        root = Path(directory)
        folder = step_folder(root, step)
        wrote, size, digest, cause = "", None, "", 0
        mine = folder / f"rank{self.rank}.pt"
        try:  # a rank that cannot write says so in the size exchange: every rank then raises, none waits
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise WriteError(write_cause(exc, root), f"cannot make {folder} ({exc})") from exc
            if on_event is not None:
                on_event("writing", step)
            size, digest = digested_save(contents, mine)
            if on_event is not None:
                on_event("written", step)
        except Exception as exc:  # noqa: BLE001 - any failure to write: a full disk, an unpicklable `extra`
            cause, wrote = getattr(exc, "cause", 4), f"{type(exc).__name__}: {exc}"
        sizes, digests, unwritten = self._files_on_every_rank(size, digest, cause)  # on the host: all have written
        if unwritten:  # nothing is committed: each rank removes its own file (a full disk gets its space back)
            with contextlib.suppress(OSError):
                mine.unlink()
            causes = "; ".join(f"rank {r}: {WRITE_CAUSES[c]}" for r, c in sorted(unwritten.items()))
            raise CheckpointError(
                f"checkpoint {folder} was not written by rank(s) {sorted(unwritten)} ({causes}; the previous one "
                "stays the latest)"
                + (f"; this rank: {wrote}" if wrote else ""))
        missing = ""
        if self.rank == 0:
            try:
                missing = _wait_until_visible(folder, sizes, self.commit_wait_s(commit_timeout_s))
                if not missing:
                    manifest = {"step": step, "world_size": self.world, "synced": contents["synced"],
                                "version": __version__, "sizes": sizes, "sha256": digests}
                    durable_write(folder / MANIFEST, lambda fd: fd.write(json.dumps(manifest).encode()))
                    durable_write(root / LATEST, lambda fd: fd.write(folder.name.encode()))
                    for old in complete_folders(root)[keep:] if keep > 0 else []:
                        shutil.rmtree(old, ignore_errors=True)
            except Exception as exc:  # noqa: BLE001 - anything: the flag below is always exchanged, no rank waits
                missing = f"rank 0 could not write the manifest or `latest` ({type(exc).__name__}: {exc})"
        failed = torch.tensor([1.0 if missing else 0.0], dtype=torch.float64, device=self.device)
        if self.allreduce_max(failed).tolist()[0]:  # on the host: rank 0 has committed, or given up
            raise CheckpointError(
                f"checkpoint {folder} was not committed (the previous one stays the latest): rank 0 did not see "
                f"every rank's file within commit_timeout_s={commit_timeout_s:g} s"
                + (f": {missing}" if missing else " (this rank's view is in rank 0's error)")
                + "; save to a folder every rank shares (a shared filesystem), or raise commit_timeout_s")
        return folder
