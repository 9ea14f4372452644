"""Streamed syncs: overlap (a sync lands overlap_steps later), fragments, both merges, exact resume in flight."""

import math

import logging
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.algorithms.contract import STEP_PROOF_BYTES
from commhooks.algorithms.qsr import state as qsr_state
from commhooks.algorithms.qsr.plan import split_fragments
from commhooks.algorithms.qsr.state import send_points
from commhooks.config import ConfigError, load_config
from tests.declared import declared
from tests.dist import run_ranks
from tests.test_outer import SGD, _batch, _net, _qsr_run

pytestmark = pytest.mark.xdist_group("test_streaming")  # its module fixtures are built once, on one worker


def _reference(steps, period, lr, mu, tau, frags, merge="progress", alpha=1.0):
    """Streaming DiLoCo written out from the docstring of commhooks.algorithms.qsr.sync, independently of
    it: fragments as equal element ranges of the flat model, sent after step ceil(period*(k+1)/frags) of
    each round, averaged by a hand-made all_gather, landing tau steps later (never after ``steps``); the
    last round ends with a blocking sync of every fragment."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), **SGD)
    params = list(net.parameters())

    def flat():
        return torch.cat([p.detach().reshape(-1) for p in params])

    def write(vec):
        offset = 0
        for p in params:
            p.data.copy_(vec[offset: offset + p.numel()].view_as(p))
            offset += p.numel()

    anchor = flat().clone()
    n = anchor.numel()
    edges = [n * k // frags for k in range(frags + 1)]
    buffers = [None] * frags
    flying = {}  # k -> (sent_at, apply_at, sent_from, mean)

    def land(k):
        sent_at, apply_at, sent_from, d = flying.pop(k)
        a, b = edges[k], edges[k + 1]
        buffers[k] = d.clone() if buffers[k] is None else mu * buffers[k] + d
        anchor[a:b] -= lr * ((d + mu * buffers[k]) if mu else d)
        theta = flat()
        if apply_at == sent_at or alpha == 0:
            theta[a:b] = anchor[a:b]
        elif merge == "progress":
            theta[a:b] = anchor[a:b] + alpha * (theta[a:b] - sent_from)
        else:
            theta[a:b] = alpha * theta[a:b] + (1 - alpha) * anchor[a:b]
        write(theta)

    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, rank)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        s = step + 1
        for k in sorted(k for k, f in flying.items() if f[1] <= s):
            land(k)
        r = (s - 1) % period + 1
        if s == steps:
            for k in sorted(flying):
                land(k)
        for k in range(frags):
            if max(1, math.ceil(period * (k + 1) / frags)) != r and s != steps:
                continue
            if k in flying:
                land(k)
            a, b = edges[k], edges[k + 1]
            theta = flat()
            delta = (anchor[a:b] - theta[a:b]).contiguous()
            every = [torch.empty_like(delta) for _ in range(world)]
            dist.all_gather(every, delta)
            flying[k] = (s, min(s + tau, steps), theta[a:b].clone(), sum(every) / world)
            if flying[k][1] <= s:
                land(k)
    return {n_: p.detach().clone() for n_, p in net.named_parameters()}


def _qsr(period, steps, **keys):
    return {"type": "qsr", "h_base": period, "alpha": 0.0, "total_steps": steps, **keys}


def _in_flight_trace(conf, steps):
    """Which steps end with a sync in flight (the hook must not wait for it at once)."""
    net = DDP(_net(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), **SGD)
    state = commhooks.ddp.register(net, opt, conf)
    trace = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, dist.get_rank())
        F.cross_entropy(net(x), y).backward()
        opt.step()
        trace.append(sorted(state.driver.in_flight))
    return trace


def _forced_sync(conf, steps):
    """``steps`` steps with syncs in flight, then ``state.sync()`` (as after a loop without total_steps)."""
    net = DDP(_net(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), **SGD)
    state = commhooks.ddp.register(net, opt, conf)
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, dist.get_rank())
        F.cross_entropy(net(x), y).backward()
        opt.step()
    before = (sorted(state.driver.in_flight), state.in_sync_at())
    state.sync()
    return before, state.in_sync_at(), torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _worker(rank, world):
    out = {}
    # overlap, the merge: synced weights + every local step made in flight; with check_every=1 the
    # anchors are proven identical after every round
    conf = _qsr(4, 12, outer_lr=0.7, outer_momentum=0.9, overlap_steps=2, check_every=1)
    out["progress"] = (_qsr_run(conf, 12)[0], _reference(12, 4, 0.7, 0.9, 2, 1))
    out["trace"] = _in_flight_trace(conf, 12)
    # the paper's mixing, in two fragments
    conf = _qsr(4, 12, overlap_steps=1, overlap_merge="mix", overlap_alpha=0.5, fragments=2)
    out["mix"] = (_qsr_run(conf, 12)[0], _reference(12, 4, 1.0, 0.0, 1, 2, "mix", 0.5))
    # fragments staggered over a blocking period, with the outer optimizer; bytes per fragment
    conf = _qsr(6, 12, outer_lr=0.7, outer_momentum=0.9, fragments=3, check_every=1)
    weights, state = _qsr_run(conf, 12)
    out["fragments"] = (weights, _reference(12, 6, 0.7, 0.9, 0, 3), state.meter.by_tag(), state.syncs)
    # torchft's choice: alpha 0 drops the in-flight steps
    conf = _qsr(4, 8, overlap_steps=1, overlap_alpha=0.0)
    out["discard"] = (_qsr_run(conf, 8)[0], _reference(8, 4, 1.0, 0.0, 1, 1, "progress", 0.0))
    # exact resume with a fragment in flight (sent at step 4, lands at 6), int8 with error feedback
    conf = _qsr(4, 16, outer_lr=0.7, outer_momentum=0.9, payload="int8", error_feedback=True, overlap_steps=2,
                fragments=2)
    out["resume"] = (_qsr_run(conf, 16)[0], _qsr_run(conf, 16, resume_at=5)[0])
    # no total_steps: after the loop, state.sync() lands what is in flight and makes the ranks identical
    conf = {"type": "qsr", "h_base": 4, "alpha": 0.0, "overlap_steps": 1, "overlap_merge": "mix",
            "overlap_alpha": 0.5, "fragments": 2}
    out["forced"] = _forced_sync(conf, 8)
    # total_steps filled in after the state was built (as the Trainer with DeepSpeed does): the last round still
    # ends with every fragment landed, the ranks identical
    net = DDP(_net(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), **SGD)
    state = commhooks.ddp.register(net, opt, {"type": "qsr", "h_base": 4, "alpha": 0.0, "overlap_steps": 2,
                                              "fragments": 2})
    state.config.total_steps = 10
    for step in range(10):
        opt.zero_grad()
        x, y = _batch(step, dist.get_rank())
        F.cross_entropy(net(x), y).backward()
        opt.step()
    out["late_total"] = (state.in_sync_at(), sorted(state.driver.in_flight),
                         torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    # the timeline of the plan's docstring, as the DEBUG log of a run shows it
    lines = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("commhooks")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        _qsr_run(_qsr(6, 12, fragments=3, overlap_steps=1), 12)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out["timeline"] = lines
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, world_size=2, timeout=300)


def _close(a, b):
    return all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a)


@pytest.mark.parametrize("case", ["progress", "mix", "fragments", "discard"])
def test_streamed_sync_equals_the_written_out_reference(results, case):
    for r in results:
        hooked, reference = r[case][:2]
        assert _close(hooked, reference), {k: (hooked[k] - reference[k]).abs().max() for k in hooked}


def test_total_steps_filled_in_later_still_ends_the_run_synced(results):
    for r in results:
        assert r["late_total"][:2] == (10, [])
    assert torch.equal(results[0]["late_total"][2], results[1]["late_total"][2])


def _docstring_timeline():
    """(optimizer step, "sent" / "landed", fragment) read off the table in commhooks.algorithms.qsr.state's docstring
    (a column's step: the header number above it; the next round's 1 is step 7)."""
    table = [ln for ln in qsr_state.__doc__.splitlines() if ln.strip().startswith(("step of round", "sent", "landed"))
             and " early " not in ln]  # (the send-before rows: torchft's timeline, tests/test_torchft_diloco.py)
    header = table[0]
    columns = {m.start(): int(m.group()) for m in re.finditer(r"\d+", header)}
    after_bar = header.index("|")
    events = []
    for line in table[1:]:
        kind = line.split()[0]
        for m in re.finditer(r"[sl](\d+)", line):
            col = min(columns, key=lambda c: abs(c - m.start() - 1))
            events.append((columns[col] + (6 if col > after_bar else 0), kind, int(m.group(1))))
    return sorted(events)


def test_the_docstring_timeline_is_what_a_run_logs(results):
    expected = _docstring_timeline()
    assert expected == [(2, "sent", 0), (3, "landed", 0), (4, "sent", 1), (5, "landed", 1), (6, "sent", 2),
                        (7, "landed", 2)]  # the parse itself
    for r in results:
        got = []
        for line in r["timeline"]:
            m = re.match(r"QSR step (\d+): fragment (\d+) (sent|landed)", line)
            if m and int(m.group(1)) <= 7:
                got.append((int(m.group(1)), m.group(3), int(m.group(2))))
        assert sorted(got) == expected, r["timeline"]


def test_overlapped_syncs_stay_in_flight_and_the_last_lands_at_total_steps(results):
    for r in results:  # sent after steps 4 and 8, landing 2 steps later; the last (step 12) lands at once
        assert r["trace"] == [[], [], [], [0], [0], [], [], [0], [0], [], [], []]
    # after the last round every rank holds the same weights, though the merges kept local progress and the
    # fragments moved on after their syncs
    for case in ("progress", "mix", "fragments"):
        a, b = results[0][case][0], results[1][case][0]
        assert all(torch.equal(a[k], b[k]) for k in a), case


def test_fragments_send_their_share_of_the_bytes(results):
    numel = sum(p.numel() for p in _net().parameters())
    for r in results:
        tags, syncs = r["fragments"][2], r["fragments"][3]
        assert syncs == 2
        sent = {t: b for t, b in tags.items() if t.startswith("sync-f")}
        assert sorted(sent) == ["sync-f0", "sync-f1", "sync-f2"]
        # each round sends every fragment once; the last one ends with a blocking sync of all three, so
        # fragments 0 and 1 (sent at steps 8 and 10) go again at step 12
        traffic = declared(_qsr(6, 12, outer_lr=0.7, outer_momentum=0.9, fragments=3, check_every=1), _net())
        assert [traffic.calls(tag=f"sync-f{k}") for k in range(3)] == [3, 3, 2]
        assert tags == traffic.by_tag(), tags  # each fragment's share of the model, with its own step proof
        assert sum(c.nbytes for c in traffic.sync) == 4 * numel + 3 * STEP_PROOF_BYTES


def test_a_forced_sync_lands_what_is_in_flight_and_makes_the_ranks_identical(results):
    (before0, at0, w0), (before1, at1, w1) = (r["forced"] for r in results)
    assert before0 == before1 == ([1], None)  # fragment 1, sent at step 8, in flight; never identical before
    assert at0 == at1 == 8 and torch.equal(w0, w1)


def test_exact_resume_with_a_sync_in_flight(results):
    for r in results:
        straight, resumed = r["resume"]
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_fragment_split_and_schedule():
    assert split_fragments([10, 1, 1, 10, 100, 3], 3) == [
        [(0, 0, 10), (1, 0, 1), (2, 0, 1), (3, 0, 10), (4, 0, 19)], [(4, 19, 61)], [(4, 61, 100), (5, 0, 3)]]
    assert split_fragments([7], 2) == [[(0, 0, 3)], [(0, 3, 7)]]  # a fragment may end inside a tensor
    assert send_points(4, 3) == {2: [0], 3: [1], 4: [2]}
    assert send_points(1, 3) == {1: [0, 1, 2]}  # a period shorter than the fragments: all at its end


@pytest.mark.parametrize("key, value", [("overlap_steps", -1), ("overlap_merge", "average"), ("overlap_alpha", 1.5),
                                        ("fragments", 0)])
def test_every_streaming_key_has_a_config_error(key, value):
    with pytest.raises(ConfigError, match=f"qsr.{key}"):
        load_config({"type": "qsr", key: value})
