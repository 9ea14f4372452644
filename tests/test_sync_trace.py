"""How much of the package one sync runs through, traced call by call: the measure of a sync a newcomer can follow.

Rank 0 of 4 gloo ranks in 2 replica groups of 2 (DDP inside each group), hierarchical QSR at a constant period
of 4 with an outer step, an int8 payload with error feedback and one step of overlap: the sync sent after step 4
lands after step 5.  ``sys.setprofile`` records every call into a file of the ``commhooks`` package during those
two optimizer steps (``optimizer.step()``, where the state's hooks run: the step before, the sync, the step
after), and during a step that neither sends nor lands (step 3).  Comprehensions and lambdas count as the tracer
sees them (each is a function of its own on Python 3.11).  The backward pass, where DDP hands its buckets to the
state's gradient reduction, is traced too and reported, not limited: it is the engine's every-step work.

The limits are those of issue #51 (before it: 15 files and 125 functions for a sync, 9 files for an idle step), plus
the phase clock every step and sync now runs through (``commhooks/phases.py``: a file, and its phase, hook and flight
timers; issue #65).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from tests.dist import run_ranks

pytestmark = pytest.mark.xdist_group("sync_trace")

PACKAGE = Path(commhooks.__file__).resolve().parent
SYNC_FILES, SYNC_FUNCTIONS, IDLE_FILES = 7, 83, 4
CONFIG = {"type": "qsr", "alpha": 0.0, "h_base": 4, "group_size": 2, "hierarchical": True, "outer_lr": 0.7,
          "outer_momentum": 0.9, "payload": "int8", "error_feedback": True, "overlap_steps": 1}


def _trace(run):
    """The package's functions ``run()`` calls: ``{(file relative to the package, qualified name, line)}``."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            path = Path(code.co_filename)
            if path.is_relative_to(PACKAGE):
                seen.add((str(path.relative_to(PACKAGE)), code.co_qualname, code.co_firstlineno))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def _worker(rank, world):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = commhooks.ddp.register(model, opt, dict(CONFIG))
    gen = torch.Generator().manual_seed(rank)

    traces = {}
    for step in range(1, 9):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        backward = lambda: F.cross_entropy(model(x), y).backward()  # noqa: E731
        backward_calls = _trace(backward) if step in (3, 4, 5) else (backward() or set())
        step_calls = _trace(opt.step) if step in (3, 4, 5) else (opt.step() or set())
        traces[step] = {"backward": sorted(backward_calls), "step": sorted(step_calls)}
    state.finish()
    return {"traces": traces, "sync_steps": list(state.sync_steps)}


@pytest.fixture(scope="module")
def traced():
    return run_ranks(_worker, world_size=4, timeout=120)[0]


def _files(calls):
    return sorted({f for f, _, _ in calls})


def test_one_sync_runs_through_few_files_and_functions(traced):
    """The step that sends plus the step that lands: at most 6 files and 80 distinct functions."""
    calls = set(map(tuple, traced["traces"][4]["step"])) | set(map(tuple, traced["traces"][5]["step"]))
    files = _files(calls)
    listing = "\n".join(f"  {f}: {q}" for f, q, _ in sorted(calls))
    assert traced["sync_steps"][:2] == [4, 8], traced["sync_steps"]  # rounds end when their last fragment leaves
    assert len(files) <= SYNC_FILES and len(calls) <= SYNC_FUNCTIONS, (
        f"one sync runs through {len(files)} files ({', '.join(files)}) and {len(calls)} functions "
        f"(at most {SYNC_FILES} and {SYNC_FUNCTIONS}):\n{listing}")


def test_a_step_that_neither_sends_nor_lands_runs_through_few_files(traced):
    files = _files(map(tuple, traced["traces"][3]["step"]))
    assert len(files) <= IDLE_FILES, f"an idle step runs through {len(files)} files: {', '.join(files)}"
