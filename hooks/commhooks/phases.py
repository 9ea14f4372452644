"""Where a step's time goes, measured where it happens and cheap enough to leave on.

Local methods sell "the sync hidden behind compute"; that is believable only when the sync's own cost is measured
phase by phase, and a user's own profiler shows the same phases.  Each rank's :class:`PhaseClock` times:

* ``compute``: from the end of the last optimizer step to the start of this one: the loop's forward and backward,
  data, and what the engine does in backward (DDP's gradient mean, a replica group's in-node mean);
* ``optimizer``: the optimizer's own update (from the end of commhooks' pre-hook to the start of its post-hook);
* ``hooks``: commhooks' step hooks themselves (the NaN guard, the step count, the schedule), their syncs aside;
* a sync's parts: ``encode`` (the change since the anchor and the payload's codec, up to the collective's start),
  ``exchange`` (the time this rank waits for a collective: a blocking sync's whole call, an overlapped sync's
  exposed wait when it lands) and ``land`` (decoding, the outer step, writing the weights, sharing parts).

Every phase is also a ``torch.profiler.record_function`` range named ``commhooks.<phase>``, so a trace of the
user's own profiler (TensorBoard, Perfetto, Chrome) shows them beside the model's own ranges.

Clocks: the host's (``time.perf_counter``).  On the CPU that is the phase's time.  On a GPU the host's clock sees
launches and the waits a sync makes (a collective's wait is a host wait on NCCL's stream); the device's own time
per kernel is in the profiler's trace.  No clock reads the device, so a step that does not sync makes no
host-device synchronisation.

The times are this process's (a resumed run counts from its restart; its bytes, kept in the checkpoint, count the
whole run).

``hidden_share``: of the time overlapped syncs were in flight, the share the rank spent computing rather than
waiting at the landing: ``1 - exposed / (in_flight + exposed)`` summed over landings, an upper bound (it counts the
flight as busy until it landed).  ``None`` without overlapped syncs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Optional

import torch

PHASES = ("compute", "optimizer", "hooks", "encode", "exchange", "land")


class PhaseClock:
    """One rank's phase times (seconds, summed) and counts; :meth:`report` per optimizer step."""

    def __init__(self):
        self.seconds: Dict[str, float] = {name: 0.0 for name in PHASES}
        self.calls: Dict[str, int] = {name: 0 for name in PHASES}
        self.inner = 0.0  # sync phases timed inside the hook being timed now (taken out of its "hooks" time)
        self.step_ended: Optional[float] = None  # when the last optimizer step's post-hook finished
        self.pre_ended: Optional[float] = None  # when this step's pre-hook finished
        self.in_flight, self.exposed = 0.0, 0.0  # overlapped syncs: time between send and landing, wait at landing
        self.steps = 0  # optimizer steps whose post-hook this clock timed

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a sync phase (and mark it as a profiler range)."""
        with torch.profiler.record_function(f"commhooks.{name}"):
            start = time.perf_counter()
            try:
                yield
            finally:
                spent = time.perf_counter() - start
                self.seconds[name] += spent
                self.calls[name] += 1
                self.inner += spent

    @contextlib.contextmanager
    def hook(self, before_step: bool):
        """Time one of commhooks' step hooks: its own work goes to ``hooks`` (the sync phases inside it to theirs);
        the pre-hook also closes ``compute``, the post-hook ``optimizer``."""
        with torch.profiler.record_function("commhooks.hooks"):
            start = time.perf_counter()
            since, name = (self.step_ended, "compute") if before_step else (self.pre_ended, "optimizer")
            if since is not None:
                self.seconds[name] += max(0.0, start - since)
                self.calls[name] += 1
            self.pre_ended = None if not before_step else self.pre_ended
            self.inner = 0.0
            try:
                yield
            finally:
                end = time.perf_counter()
                self.seconds["hooks"] += max(0.0, end - start - self.inner)
                self.calls["hooks"] += 1
                self.inner = 0.0
                if before_step:
                    self.pre_ended = end
                else:
                    self.step_ended = end
                    self.steps += 1

    def flight(self, in_flight_s: float, exposed_s: float) -> None:
        """An overlapped sync landed: it was in flight for ``in_flight_s`` while the rank trained on, and the rank
        then waited ``exposed_s`` for it."""
        self.in_flight += in_flight_s
        self.exposed += exposed_s

    def report(self, steps: int) -> dict:
        """Per phase the mean milliseconds per optimizer step (over ``steps``) and the calls; the hidden share."""
        per_step = {name: {"ms_per_step": round(1000 * self.seconds[name] / steps, 4) if steps else 0.0,
                           "calls": self.calls[name]} for name in PHASES}
        total = self.in_flight + self.exposed
        return {"phases": per_step, "hidden_share": round(1 - self.exposed / total, 4) if total > 0 else None}
