"""Checkpoints on a schedule, written off the training thread, and the resume that finds them after a restart.

A long run across slow links will lose a rank: a node reboots, a job is
requeued, a process is killed.  torchrun (``--max-restarts``) and SLURM
(``--requeue``) start the script again; what they cannot do is bring back the
work.  Three lines do::

    ckpt = commhooks.Checkpointer("ckpt", model, optimizer, state, scheduler, every_seconds=600)
    for step in range(ckpt.start_step, total_steps):   # 0 on a fresh start, the saved step after a restart
        ...; optimizer.step(); scheduler.step()
        ckpt.after_step()
    ckpt.close()                                       # waits for the last file; raises its error, if any

``resume="auto"`` (the default) loads the newest complete checkpoint in the
folder when there is one, so the same command line serves the first start and
every restart; resume is exact (see :mod:`commhooks.checkpoint`): a run killed
any number of times ends with the parameters of a run never killed.

Why off the thread.  A save at step N copies what it needs to host memory on
the training thread (the model, the optimizer, the hook state, the scheduler,
the RNG: for a model of P parameters and Adam about 3P values) and training
goes on; a writer thread writes the file, forces it to disk and commits it.
The commit needs every rank (rank 0 writes the manifest only once every
rank's file is durable), so the writer talks over a gloo group of its own,
made here: its collectives never interleave with training's, and under NCCL
it holds the writer, not the GPU stream, until every rank has written.  One
save is in flight at a time: a save due while the previous one is still
being written waits for it first, and so does :meth:`close`; that wait is
where a writer's error (a full disk, a missing rank file) is raised, on every
rank at the same step.  Without torch.distributed (Horovod) the save runs on
the training thread, through the hook's collectives.

Tuning.  ``every_seconds`` bounds the work a fault loses (half of it on
average) and is the knob that survives a change of model or cluster; the
ranks agree on the step to save at from their measured step time (one tiny
allreduce about twice per interval, never per step).  ``every_steps`` saves
at fixed step multiples (both may be given: whichever comes first).  The
stall a save costs is the host copy; a save every few minutes is cheap even
for large models, while each save keeps ``keep`` complete checkpoints on disk.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .checkpoint import checkpoint_contents, load_checkpoint
from .commit import CommitGroup, just_synced

RESUME = ("auto", "never")


def host_copy(obj):
    """A copy of a state-dict tree that training can no longer change: tensors copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(host_copy(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


class Checkpointer:
    """Periodic, crash-safe, exact checkpoints of a hooked run, and ``resume="auto"``; collective.

    Arguments as :func:`commhooks.save_checkpoint` (``model`` may be wrapped), plus:
    ``every_steps`` (int >= 0, 0: off) and ``every_seconds`` (float >= 0, 0: off): when to save;
    ``resume``: ``"auto"`` loads the newest complete checkpoint of ``directory`` if there is one,
    ``"never"`` starts fresh (a later save still commits over older ones);
    ``background`` (default True): write and commit on a writer thread, whose gloo group waits ``write_timeout_s``
    for the slowest rank's file (default the larger of 300 s and twice ``commit_timeout_s``);
    ``on_event(name, step)``: called with ``"saving"`` (training thread, the copy taken), ``"writing"`` and
    ``"written"`` (this rank's file, on the writer thread) and ``"committed"``: for logs and fault injection.

    ``start_step`` is the step to go on from (0 on a fresh start); ``resumed_from`` the loaded step or None.
    """

    def __init__(self, directory, model, optimizer, state=None, scheduler=None, *, every_steps: int = 0,
                 every_seconds: float = 0.0, resume: str = "auto", keep: int = 2, background: bool = True,
                 commit_timeout_s: float = 60.0, write_timeout_s: Optional[float] = None, extra=None,
                 on_event: Optional[Callable[[str, int], None]] = None):
        if not isinstance(every_steps, int) or isinstance(every_steps, bool) or every_steps < 0:
            raise ValueError(f"Checkpointer: every_steps must be an int >= 0 (0: off), got {every_steps!r}")
        if not isinstance(every_seconds, (int, float)) or isinstance(every_seconds, bool) or every_seconds < 0 \
                or not math.isfinite(every_seconds):
            raise ValueError(f"Checkpointer: every_seconds must be a number >= 0 (0: off), got {every_seconds!r}")
        if resume not in RESUME:
            raise ValueError(f"Checkpointer: resume must be one of {RESUME}, got {resume!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"Checkpointer: keep must be an int >= 1, got {keep!r}")
        for name, value in (("commit_timeout_s", commit_timeout_s), ("write_timeout_s", write_timeout_s)):
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"Checkpointer: {name} must be a number of seconds > 0, got {value!r}")
        if not getattr(getattr(state, "comm", None), "fixed_world", True) and (resume != "never" or every_seconds):
            raise ValueError("Checkpointer: this state's replica groups come and go (commhooks.torchft): pass "
                             "checkpoint_dir= and checkpoint_every= to commhooks.torchft.register instead (the groups "
                             "save at the same steps and agree on the one to resume from); see "
                             "docs/pages/operations/fault-tolerance.md")
        self.directory = Path(directory)
        self.model, self.optimizer, self.state, self.scheduler = model, optimizer, state, scheduler
        self.every_steps, self.every_seconds, self.keep, self.extra = every_steps, float(every_seconds), keep, extra
        self.commit_timeout_s = commit_timeout_s
        # the writers wait for the slowest rank's whole write at the size exchange: not the hook's (short) timeout
        self.write_timeout_s = write_timeout_s or max(300.0, 2 * commit_timeout_s)
        self.on_event = on_event or (lambda name, step: None)
        self.commit_group = CommitGroup(state, model)  # the step agreements, and the commit without a writer thread
        self.rank, self.world = self.commit_group.rank, self.commit_group.world
        self._writers = None  # the same ranks over a gloo group of their own: the writer thread's commit
        self._background = background
        if background and self.world > 1:
            if dist.is_available() and dist.is_initialized():  # every rank makes it, here, in the same order
                self._writers = self.commit_group.over(
                    dist.new_group(backend="gloo", timeout=timedelta(seconds=self.write_timeout_s)),
                    self.write_timeout_s)  # rank 0 gives up on a commit before the others stop waiting
            else:
                self._background = False  # Horovod: the hook's collectives, on the training thread
        self._writer: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.saved_steps = []  # the steps committed by this process, in order
        ck = load_checkpoint(self.directory, model, optimizer, state, scheduler) if resume == "auto" else None
        self.resumed_from = None if ck is None else int(ck["step"])
        self.start_step = self.resumed_from or 0
        self._step = self.start_step
        self._last_save_step, self._last_save_time = self.start_step, time.monotonic()
        self._next_check = self.start_step + 1

    # ------------------------------------------------------------------ the schedule

    def after_step(self, step: Optional[int] = None) -> bool:
        """Call once per optimizer step, after it (and after the scheduler's step), on every rank.

        ``step``: the number of steps done; default the hook's count (``state.step``), else this object's (from
        ``start_step``).
        Returns whether a save started.
        """
        counted = getattr(self.state, "step", None)  # a hook's own count ({"type": "none"} keeps none)
        self._step = step if step is not None else (counted if counted is not None else self._step + 1)
        if self._step == self._last_save_step or not self._due(self._step):  # (a step saved once only)
            return False
        self.save(self._step)
        return True

    def _due(self, step: int) -> bool:
        if self.every_steps and step % self.every_steps == 0:
            return True
        if not self.every_seconds or step < self._next_check:
            return False
        # the ranks' clocks differ: agree on the slowest rank's elapsed time (one tiny allreduce, at checks only)
        elapsed = self.commit_group.allreduce_max(torch.tensor(
            [time.monotonic() - self._last_save_time], dtype=torch.float64, device=self.commit_group.device)).item()
        if elapsed >= self.every_seconds:
            return True
        per_step = elapsed / max(1, step - self._last_save_step)
        self._next_check = step + max(1, math.ceil((self.every_seconds - elapsed) / max(per_step, 1e-9)))
        return False

    # ------------------------------------------------------------------ saving

    def save(self, step: Optional[int] = None) -> None:
        """Save now (collective): wait for the previous save, take the copy, and write it (off the thread)."""
        step = self._step if step is None else step
        self.wait()
        self.commit_group.agree_to_save(step, who="Checkpointer")
        contents = host_copy(checkpoint_contents(self.model, self.optimizer, self.state, self.scheduler, step,
                                                 just_synced(self.state, step), self.extra))
        self._last_save_step, self._last_save_time = step, time.monotonic()
        self._next_check = step + 1
        self.on_event("saving", step)
        if self._background:
            self._writer = threading.Thread(target=self._write, args=(step, contents), daemon=True,
                                            name=f"commhooks-checkpoint-{step}")
            self._writer.start()
        else:
            self._write(step, contents)
            self._raise_error()

    def _write(self, step: int, contents: dict) -> None:
        try:
            group = self._writers if self._writers is not None else self.commit_group
            group.commit(self.directory, step, contents, self.keep, self.commit_timeout_s, self.on_event)
            self.saved_steps.append(step)
            self.on_event("committed", step)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by wait()
            self._error = exc

    def wait(self) -> None:
        """Wait for the save in flight; raise its error (the same on every rank: the commit is collective)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Wait for the last save; raise its error.  Call on every rank at the end of training."""
        self.wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        elif self._writer is not None:  # training failed: let the save finish or fail, keep the first error
            self._writer.join()
            self._writer = None
        return False
