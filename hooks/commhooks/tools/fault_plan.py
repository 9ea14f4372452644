"""Faults a training process deals itself at planned steps, and the progress it reports to the injector.

The injector (:mod:`commhooks.tools.faults`) kills, stops and cuts ranks from outside, at times; a test that
needs a fault at an exact point (after step 37, or while rank 1 writes its checkpoint file) cannot hit it from
outside reliably, so the trainer takes a plan (``commhooks train --fault-plan plan.json``)::

    [{"rank": 1, "step": 37, "at": "step"},      # SIGKILL after optimizer step 37
     {"rank": 1, "step": 60, "at": "save"}]      # SIGKILL as rank 1 starts writing checkpoint 60

The kill is a real ``SIGKILL`` of the process, sent by itself.  Each fault fires once in the job's life: a
marker file beside the plan (``plan.json.fired<i>``, forced to disk first) tells the restarted process that the
step it is about to redo already had its fault.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import List, Optional

WHEN = ("step", "save")


def load_plan(path) -> List[dict]:
    """The plan's faults, checked: each a dict with an int ``rank`` and ``step`` >= 1 and ``at`` in WHEN."""
    faults = json.loads(Path(path).read_text())
    if not isinstance(faults, list):
        raise ValueError(f"{path}: a fault plan is a JSON list of faults")
    for i, f in enumerate(faults):
        if not (isinstance(f, dict) and isinstance(f.get("rank"), int) and isinstance(f.get("step"), int)
                and f["step"] >= 1 and f.get("at", "step") in WHEN):
            raise ValueError(f"{path}: fault {i} must be {{\"rank\": int, \"step\": int >= 1, \"at\": one of {WHEN}}}, "
                             f"got {f!r}")
    return faults


class PlannedFaults:
    """This rank's part of a plan; a no-op without one."""

    def __init__(self, path: Optional[str], rank: int):
        self.path = None if path is None else Path(path)
        self.mine = [] if path is None else [(i, f) for i, f in enumerate(load_plan(path)) if f["rank"] == rank]

    def _fire(self, at: str, step: int) -> None:
        for i, f in self.mine:
            if f["step"] == step and f.get("at", "step") == at:
                marker = self.path.with_name(f"{self.path.name}.fired{i}")
                try:
                    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    continue  # fired before this restart
                os.write(fd, f"{time.time():.3f} pid {os.getpid()}\n".encode())
                os.fsync(fd)
                os.close(fd)
                print(f"[commhooks] fault plan: SIGKILL of rank {f['rank']} at {at} {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step: int) -> None:
        if self.mine:
            self._fire("step", step)

    def on_event(self, name: str, step: int) -> None:
        """The Checkpointer's events: a fault ``at: save`` fires as this rank starts writing its file."""
        if self.mine and name == "writing":
            self._fire("save", step)


class ProgressFile:
    """Rank 0's latest step, rewritten at most every 0.05 s (the injector counts the steps redone from it)."""

    def __init__(self, path: Optional[str]):
        self.path = None if path is None else Path(path)
        self._last = 0.0

    def update(self, step: int, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if force or now - self._last >= 0.05:
            self._last = now
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(f"{step}\n")
            os.replace(tmp, self.path)
