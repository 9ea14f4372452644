"""Where a step's time goes: every rank times its steps' phases, and a user's own profiler sees them as ranges.

2 gloo ranks under DDP, QSR with an outer step, an int8 payload and one step of overlap: ``state.report()`` gives
each phase's time per step (compute, the optimizer, commhooks' hooks, a sync's encode, exchange and landing) and the
share of the overlapped syncs' flight that was hidden; a ``torch.profiler`` trace of the loop holds the
``commhooks.*`` ranges; an engine that drives the steps itself (``begin_step`` / ``end_step``, as DeepSpeed's and
Horovod's adapters do) is timed the same way.
"""

import json

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.phases import PHASES
from tests.dist import run_ranks

STEPS = 12
CONFIG = {"type": "qsr", "h_base": 3, "outer_lr": 0.7, "outer_momentum": 0.5, "payload": "int8",
          "error_feedback": True, "overlap_steps": 1, "total_steps": STEPS}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(rank, world, trace_path):
    from torch.profiler import ProfilerActivity, profile

    net = DDP(_model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    state = commhooks.ddp.register(net, opt, CONFIG)
    g = torch.Generator().manual_seed(rank)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    if rank == 0:
        prof.export_chrome_trace(trace_path)
    report = state.report()
    state.remove()
    # an engine that drives the steps (DeepSpeed's, Horovod's adapter): begin_step / end_step around its update
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    driven = commhooks.QSRState(opt, model=plain, engine=commhooks.facts.for_model(plain, drives_steps=True),
                                config={"type": "qsr", "h_base": 3, "total_steps": STEPS})
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        driven.begin_step()
        opt.step()
        driven.end_step()
    return report, driven.report()


def test_report_gives_each_phase_per_step_and_a_profiler_trace_shows_the_ranges(tmp_path):
    trace = tmp_path / "trace.json"
    (report, driven), _ = run_ranks(_train, 2, timeout=120, trace_path=str(trace))
    phases = report["phases"]
    assert set(phases) == set(PHASES), phases
    for name in ("compute", "optimizer", "hooks", "encode", "exchange", "land"):
        assert phases[name]["calls"] > 0 and phases[name]["ms_per_step"] > 0, (name, phases)
    assert phases["optimizer"]["calls"] == STEPS and phases["compute"]["calls"] == STEPS - 1, phases
    # every sync of the run left and landed: one encode and one landing each (the overlap: a step later)
    assert phases["encode"]["calls"] == phases["land"]["calls"] == report["syncs"], (phases, report["syncs"])
    assert 0.0 <= report["hidden_share"] <= 1.0, report["hidden_share"]
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    # (compute is the time between two hooks, not a range of its own: the model's own ranges are there)
    for name in ("commhooks.hooks", "commhooks.encode", "commhooks.exchange", "commhooks.land"):
        assert name in names, sorted(n for n in names if n and n.startswith("commhooks"))
    d = driven["phases"]
    assert d["hooks"]["calls"] == 2 * STEPS and d["optimizer"]["calls"] == STEPS, d
    assert d["exchange"]["calls"] == driven["syncs"] > 0 and driven["hidden_share"] is None, driven
