"""What a GPU with NCCL would object to, checked on the CPU (see tests/devicecheck.py), and means like DDP's.

* every tensor factory in the library names its device (source), and at run time no tensor is made on a
  default device, over QSR (plain; outer step + int8 + overlap + fragments + error feedback), AB, AB x QSR,
  a GradScaler run and a checkpoint save and load;
* zero host-device synchronisations from commhooks code on an optimizer step that does not sync, in the
  default configs; the count per sync is printed (the README states it);
* a checkpoint loads onto another device than the one it was written from (proxy: a one-rank state whose
  parameters are on ``meta``: every tensor it holds after the load must be there);
* an fp16 mean whose sum would overflow does not (divide first, as DDP's default hook).
"""

from __future__ import annotations

import ast
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from tests.devicecheck import FACTORIES, LIBRARY, DeviceRuleError, StrictDevices
from tests.dist import run_ranks

# --------------------------------------------------------------------------
# source: every factory call names its device
# --------------------------------------------------------------------------

FACTORY_NAMES = {f.__name__ for f in FACTORIES}
# `.cpu()` in the library: only where the tensor is meant for the host (a checkpoint file, a report)
CPU_ALLOWED = {"tools/train.py", "tools/measure.py", "tools/bench.py"}


def _calls(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            yield node


def test_every_tensor_factory_in_the_library_names_its_device():
    bare, to_cpu = [], []
    for path in sorted(LIBRARY.rglob("*.py")):
        rel = str(path.relative_to(LIBRARY))
        for call in _calls(path):
            f = call.func
            if (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORY_NAMES
                    and not any(k.arg == "device" for k in call.keywords)):
                bare.append(f"{rel}:{call.lineno} torch.{f.attr}")
            if f.attr == "cpu" and not call.args and rel not in CPU_ALLOWED:
                to_cpu.append(f"{rel}:{call.lineno}")
    assert not bare, f"tensor factories without device= (an NCCL group refuses the CPU tensor they make): {bare}"
    assert not to_cpu, f".cpu() in the library (a host stall on a GPU; a collective then refuses it): {to_cpu}"


def test_the_check_catches_a_bare_factory_and_counts_host_reads():
    src = ("import torch\n"
           "def bare(): return torch.zeros(1)\n"
           "def named(x): return torch.zeros(1, device=x.device)\n"
           "def reads(x): return x[0].item() + float(x[1]) + len(x.tolist()) + bool(x[0])\n")
    ns: dict = {}
    exec(compile(src, str(LIBRARY / "algorithms" / "_probe.py"), "exec"), ns)
    x = torch.ones(3)
    with StrictDevices() as mode:
        ns["named"](x)
        with pytest.raises(DeviceRuleError, match=r"algorithms/_probe.py:2: torch.zeros\(...\) without device="):
            ns["bare"]()
        ns["reads"](x)
        assert mode.take()[0] == 4
        float(x[0]), x.tolist(), torch.zeros(2)  # the test's own calls are not the library's
        assert mode.take()[0] == 0


# --------------------------------------------------------------------------
# run time, 2 gloo ranks: QSR, QSR outer + int8 + overlap + fragments, int4 by the two-step exchange, AB, AB x QSR,
# GradScaler, checkpoints
# --------------------------------------------------------------------------

CASES = {
    "qsr": {"type": "qsr", "h_base": 3},
    "qsr-outer-int8-overlap-fragments": {"type": "qsr", "h_base": 6, "outer_lr": 0.7, "outer_momentum": 0.9,
                                         "payload": "int8", "error_feedback": True, "overlap_steps": 1,
                                         "fragments": 2, "total_steps": 12},
    "qsr-outer-int4-two-step": {"type": "qsr", "h_base": 3, "outer_lr": 0.7, "outer_momentum": 0.9, "payload": "int4",
                                "error_feedback": True, "payload_exchange": "two_step", "total_steps": 12},
    "ab": {"type": "ab", "warmup_steps": 2, "sync_period": 5, "full_rank_steps": 1, "group_size": 1,
           "min_compression_rate": 1.01, "rank_cutoff": 0.8},
    "ab-x-qsr-int8": {"type": "ab", "warmup_steps": 2, "sync_rule": "qsr", "h_base": 3, "sync_period": 4, "full_rank_steps": 1,
                      "group_size": 1, "payload": "int8", "min_compression_rate": 1.01, "rank_cutoff": 0.8},
}
GRAD_TAGS = {"grad", "group-grad", "ab-grad", "full-grad"}  # every step's traffic; the rest is a sync's


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(),
                         nn.Linear(24, 3))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 12, generator=g, device="cpu"), torch.randint(0, 3, (16,), generator=g, device="cpu")


def _sync_marks(state) -> tuple:
    """What changes when a step takes part in a sync: the sync collectives issued, the in-flight syncs (one that
    lands on a later step is that sync's end)."""
    calls = sum(c["calls"] for key, c in state.meter.snapshot().items() if key.split("/")[2] not in GRAD_TAGS)
    driver = getattr(state, "driver", None)
    flights = tuple(sorted((k, f.flight.sent_at) for k, f in enumerate(driver.fragments) if f.flight)) if (
        driver is not None) else ()
    return calls, flights


def _train(net, opt, state, steps, first, rank, mode, scaler=None):
    """Steps ``first..first+steps-1``; returns [(host reads, synced)] per step."""
    per_step = []
    for step in range(first, first + steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        before = _sync_marks(state)
        loss = F.cross_entropy(net(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        reads, where = mode.take()
        per_step.append((reads, _sync_marks(state) != before, where))
    return per_step


def _gpu_rules(rank, world, checkpoint_dir):
    out = {}
    mode = StrictDevices()
    with mode:
        for name, conf in CASES.items():
            net = DDP(_model(), forward_sync_buffers=False)
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
            state = commhooks.ddp.register(net, opt, conf)
            mode.take()
            steps = _train(net, opt, state, 12, 0, rank, mode)
            out[name] = {"steps": [(r, s) for r, s, _ in steps], "first": steps[0][2],  # (the first: set-up)
                         "quiet_reads": {k: v for r, s, w in steps[1:] if not s and r for k, v in w.items()}}
        # a GradScaler run: the one host read per step is the one torch's own scaler makes (found_inf)
        net = DDP(_model(), forward_sync_buffers=False)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        state = commhooks.ddp.register(net, opt, CASES["qsr"], scaler=scaler)
        mode.take()
        steps = _train(net, opt, state, 6, 0, rank, mode, scaler=scaler)
        out["qsr-gradscaler"] = {"steps": [(r, s) for r, s, _ in steps], "first": steps[0][2],
                                 "quiet_reads": {k: v for r, s, w in steps[1:] if not s and r for k, v in w.items()}}
        # checkpoint mid-overlap (a fragment in flight), load into a fresh model and state, go on
        conf = CASES["qsr-outer-int8-overlap-fragments"]
        net = DDP(_model(), forward_sync_buffers=False)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        state = commhooks.ddp.register(net, opt, conf)
        _train(net, opt, state, 6, 0, rank, mode)  # fragment 0 sent at step 6, lands at 7: in flight
        assert state.driver.in_flight
        commhooks.save_checkpoint(checkpoint_dir, net, opt, state)
        net2 = DDP(_model(), forward_sync_buffers=False)
        opt2 = torch.optim.SGD(net2.parameters(), lr=0.05, momentum=0.9)
        state2 = commhooks.ddp.register(net2, opt2, conf)
        ck = commhooks.load_checkpoint(checkpoint_dir, net2, opt2, state2)
        _train(net, opt, state, 3, 6, rank, mode)
        _train(net2, opt2, state2, 3, 6, rank, mode)
        out["resume_exact"] = ck["step"] == 6 and all(
            torch.equal(a, b) for a, b in zip(net.module.parameters(), net2.module.parameters()))
    return out


def test_gpu_rules_on_cpu_no_default_device_and_quiet_steps(capsys):
    with tempfile.TemporaryDirectory() as ckdir:
        results = run_ranks(_gpu_rules, 2, timeout=240, checkpoint_dir=ckdir)
    for rank, res in enumerate(results):
        assert res.pop("resume_exact"), f"rank {rank}: resume from the in-flight checkpoint is not exact"
        for case, r in res.items():
            syncs = sum(s for _, s in r["steps"])
            assert syncs >= 2, (case, r["steps"])  # the case really synced (its host reads were counted)
            assert not r["quiet_reads"] or case == "qsr-gradscaler", (case, r["quiet_reads"])
            # the first step, once: an outer step's anchor asks whether the ranks start equal (one host read)
            anchor_check = {k: v for k, v in r["first"].items() if "contract/checks.py" in k}
            assert sum(anchor_check.values()) == (1 if "outer" in case else 0), (case, r["first"])
            if case == "qsr-gradscaler":  # found_inf, as torch's own GradScaler.step reads it
                assert all(n == 1 for n in r["quiet_reads"].values()) and all(
                    reads == 1 for reads, synced in r["steps"] if not synced), r
    with capsys.disabled():
        for case, r in results[0].items():
            at_syncs = sorted({reads for reads, synced in r["steps"] if synced})
            print(f"\n[host reads] {case}: non-sync steps {[reads for reads, s in r['steps'] if not s]}, "
                  f"sync steps {at_syncs}")


# --------------------------------------------------------------------------
# checkpoint onto another device (proxy: meta), one rank
# --------------------------------------------------------------------------


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _held(state):
    """Every tensor a state keeps: outer anchors, momentum, residuals, in-flight results, AB bases, entry."""
    found = []
    for o in getattr(getattr(state, "driver", None), "fragments", []):
        found += [t for t in (o.anchor, o.buffer, o.residual) if t is not None]
        if o.flight is not None:
            found += [o.flight.sent_from, *o.flight.work.wait()]
    for b in getattr(state, "bases", {}).values():
        found += [t for t in (b.a, b.b, b.s, b.residual) if t is not None]
    if getattr(state, "entry", None) is not None:
        found.append(state.entry)
    return found


def _one_rank_checkpoint(rank, world, conf, steps):
    if conf["type"] == "ab":
        conf = {**{k: v for k, v in conf.items() if k != "group_size"}, "mode": "only-b"}  # one rank: one group,
        # the whole world trains B (only-b's group is the world: group_size would change nothing, and is refused)
    net = DDP(_model(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = commhooks.ddp.register(net, opt, conf)
    for step in range(steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    saved = state.state_dict()
    n_saved = len(list(_tensors(saved)))
    # the proxy of "another device": the same model on meta (a one-rank state never calls a collective)
    meta_model = _model().to("meta")
    meta_opt = torch.optim.SGD(meta_model.parameters(), lr=0.05, momentum=0.9)
    conf = dict(conf, warmup_steps=max(conf.get("warmup_steps", 0), 1000)) if conf["type"] == "ab" else conf
    other = type(state)(optimizer=meta_opt, model=meta_model, config=conf)
    other.load_state_dict(saved)
    held = _held(other)
    return n_saved, len(held), sorted({str(t.device) for t in held})


@pytest.mark.parametrize("case", ["qsr-outer-int8-overlap-fragments", "ab", "ab-x-qsr-int8"])
def test_checkpoint_lands_on_the_parameters_device(case):
    steps = {"qsr-outer-int8-overlap-fragments": 6, "ab": 4, "ab-x-qsr-int8": 3}[case]  # mid-phase, in flight
    (n_saved, n_held, devices), = run_ranks(_one_rank_checkpoint, 1, conf=CASES[case], steps=steps)
    assert n_saved >= 3 and n_held >= 3, (n_saved, n_held)  # there is something to move
    assert devices == ["meta"], devices


# --------------------------------------------------------------------------
# means like DDP's
# --------------------------------------------------------------------------


def _fp16_mean(rank, world):
    from commhooks.comm.torch_dist import TorchComm

    comm = TorchComm()
    big = torch.full((8,), 40000.0 + rank * 8000.0, dtype=torch.float16)  # sum 88000 > fp16's 65504
    comm.allreduce([big], op="mean", tag="grad")
    pair = [torch.full((3,), 60000.0, dtype=torch.float16), torch.full((2,), -60000.0, dtype=torch.float16)]
    comm.allreduce(pair, op="mean", tag="grad")
    return big.float().tolist(), [t.float().tolist() for t in pair]


def test_fp16_mean_divides_before_the_sum_and_does_not_overflow():
    for big, pair in run_ranks(_fp16_mean, 2):
        assert all(math.isfinite(v) and v == 44000.0 for v in big), big
        assert pair == [[60000.0] * 3, [-60000.0] * 2], pair


# --------------------------------------------------------------------------
# memory the algorithm keeps, stated by state.report()
# --------------------------------------------------------------------------


def _memory(rank, world, conf):
    net = DDP(_model(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = commhooks.ddp.register(net, opt, conf)
    for step in range(5):
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    params = [p for p in net.module.parameters()]
    return state.report(), sum(p.numel() for p in params), len(params), state.syncs


@pytest.mark.parametrize("extra, expect", [
    ({}, {}),  # plain averaging keeps nothing
    ({"outer_lr": 0.7}, {"anchor": 1, "sync_buffers": 1}),  # blocking: the send buffer (+ the proof)
    ({"outer_lr": 0.7, "outer_momentum": 0.9, "payload": "int8", "error_feedback": True},
     {"anchor": 1, "outer_momentum": 1, "residual": 1, "sync_buffers": 1}),
    ({"outer_lr": 0.7, "overlap_steps": 1}, {"anchor": 1, "sync_buffers": 3}),  # + the weights sent from, now
])
def test_report_states_the_memory_each_feature_keeps(extra, expect):
    (report, n, tensors, syncs), = run_ranks(_memory, 1, conf={"type": "qsr", "h_base": 2, **extra})
    assert syncs >= 2
    memory = report["memory_bytes"]
    proof = 4 * commhooks.algorithms.contract.steps.PROOF_ELEMENTS if extra.get("payload", "fp32") == "fp32" else 0
    want = {k: 4 * n * v + (proof if k == "sync_buffers" else 0) for k, v in expect.items()}
    want["nonfinite_guard"] = 8 * tensors
    assert {k: v for k, v in memory.items() if k != "total"} == want, (memory, want)
    assert memory["total"] == sum(want.values())
    assert report["memory_vs_weights"] == round(sum(want.values()) / (4 * n), 3)
