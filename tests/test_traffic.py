"""Traffic declarations against the meter on 4 real gloo ranks in pairs: every step's bytes by tag, every rank.

The combinations no other meter test covers: hierarchical syncs with optimizer moments and BatchNorm buffers,
fragmented int8 syncs landing a step later and shared in the pair, top-k in three fragments, an outer step taken
by a torch optimizer given in Python (the config alone names a plain mean); the declaration
(``registry.declared_traffic``) must say what each rank's meter counts at each step.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from tests.declared import declared
from tests.dist import run_ranks

pytestmark = pytest.mark.xdist_group("test_traffic")  # its module fixtures are built once, on one worker

STEPS = 10
CONFIGS = {
    "hier-moments": {"type": "qsr", "h_base": 3, "group_size": 2, "hierarchical": True,
                     "average_optimizer_state": True},
    "hier-int8-fragments-overlap": {"type": "qsr", "h_base": 4, "group_size": 2, "hierarchical": True,
                                    "payload": "int8", "payload_block": 32, "error_feedback": True, "fragments": 2,
                                    "overlap_steps": 1, "average_optimizer_state": True},
    "topk-fragments-outer": {"type": "qsr", "h_base": 2, "alpha": 0.0, "payload": "topk", "topk_chunk": 64,
                             "error_feedback": True, "fragments": 3, "outer_lr": 0.7, "outer_momentum": 0.9},
    "rule-replicas": {"type": "qsr", "h_base": 2, "alpha": 0.3, "warmup_steps": 2, "group_size": 2},
    # torchft's timeline: each fragment sent a step before its point and landing on it, mixed at every sync
    "send-before-mix": {"type": "qsr", "h_base": 4, "fragments": 2, "outer_lr": 2.0, "overlap_steps": 1,
                        "overlap_schedule": "send-before", "overlap_merge": "mix", "overlap_alpha": 0.5},
    # a torch optimizer takes the outer step (Python only): no outer_* key, yet every sync is an outer step
    "outer-optimizer": {"type": "qsr", "h_base": 3, "alpha": 0.0},
}
OUTER_OPTIMIZER = {"outer-optimizer": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def lr_at(step):
    return 0.05 * (1 - step / STEPS) + 1e-3


def _bytes_per_step(rank, conf, **options):
    """``conf`` (a dict with its ``total_steps``) on this rank for STEPS AdamW steps: each step's bytes by tag."""
    net = DDP(_model(), forward_sync_buffers=False)
    opt = torch.optim.AdamW(net.parameters(), lr=lr_at(0))
    state = commhooks.ddp.register(net, opt, conf, **options)
    steps = []
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        before = dict(state.meter.by_tag())
        g = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        F.cross_entropy(net(torch.randn(16, 8, generator=g)), torch.randint(0, 4, (16,), generator=g)).backward()
        opt.step()
        steps.append({t: b - before.get(t, 0) for t, b in state.meter.by_tag().items() if b - before.get(t, 0)})
    return steps


def _worker(rank, world):
    return {name: _bytes_per_step(rank, {**conf, "total_steps": STEPS},
                                  **({"outer_optimizer": OUTER_OPTIMIZER[name]} if name in OUTER_OPTIMIZER else {}))
            for name, conf in CONFIGS.items()}


@pytest.fixture(scope="module")
def measured():
    return run_ranks(_worker, 4, timeout=300)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_meter_counts_what_qsr_declares(measured, name):
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    for rank, r in enumerate(measured):
        traffic = declared({**CONFIGS[name], "total_steps": STEPS}, model, world=4, steps=STEPS, rank=rank,
                           local_world=2, lr=lr_at, moments=2 * numel,  # AdamW: exp_avg, exp_avg_sq
                           outer_optimizer=name in OUTER_OPTIMIZER)
        assert r[name] == [traffic.at(s + 1) for s in range(STEPS)], (rank, r[name])
        assert traffic.syncs >= 2


def _recorded_qsr_configs():
    """Every QSR configuration a recorded benchmark ran (results/*/results.json), with the world it ran on:
    ``{world: [(label, config dict)]}`` (2 ranks, or 4 ranks in nodes of 2)."""
    import json
    from pathlib import Path

    from commhooks.tools import bench, plan

    found = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "results").glob("*/results.json")):
        setup = json.loads(path.read_text())["setup"]
        for name in json.loads(path.read_text())["methods"]:
            try:
                source = bench.method_source(name, setup.get("model", "cnn"))
            except KeyError:  # a method since retired
                continue
            raw = plan.read_config(source["config"]) if "config" in source else {}
            if raw.get("type") == "qsr":
                found.setdefault((setup["ranks"], json.dumps(raw, sort_keys=True)), f"{path.parent.name}/{name}")
    out = {}
    for (world, raw), label in sorted(found.items()):
        out.setdefault(world, []).append((label, {**json.loads(raw), "total_steps": STEPS}))
    return out


RECORDED = _recorded_qsr_configs()
LOCAL = {2: 1, 4: 2}  # ranks per node: the recorded runs' 2 nodes


def _node_env(local, rank):
    return {"LOCAL_WORLD_SIZE": str(local), "LOCAL_RANK": str(rank % local)}


def _recorded_worker(rank, world):
    return {label: _bytes_per_step(rank, conf) for label, conf in RECORDED[world]}


@pytest.mark.parametrize("world", sorted(RECORDED))
def test_every_recorded_configuration_matches_its_declaration_step_by_step(world):
    """The recorded benchmarks' QSR configurations (their model aside) on real gloo ranks in 2 nodes:
    each step's bytes by tag on every rank are what the declaration, reading the same plan and timeline, says."""
    assert len(RECORDED[world]) >= 5
    measured = run_ranks(_recorded_worker, world, timeout=300, env=functools.partial(_node_env, LOCAL[world]))
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    for rank, r in enumerate(measured):
        for label, conf in RECORDED[world]:
            traffic = declared(conf, model, world=world, steps=STEPS, rank=rank, local_world=LOCAL[world], lr=lr_at,
                               moments=2 * numel)
            assert r[label] == [traffic.at(s + 1) for s in range(STEPS)], (label, rank, r[label])
