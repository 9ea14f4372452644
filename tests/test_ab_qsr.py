"""AB x QSR: AB groups that sync by the quadratic rule (sync_rule="qsr")."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.algorithms.ab import phases
from commhooks.config import ABConfig, ConfigError
from tests.dist import run_ranks
from tests.test_ab import batch, mlp, weights

REPO = Path(__file__).resolve().parents[1]
TOTAL, PEAK, LR_WARMUP = 120, 0.1, 10
RULE = dict(warmup_steps=12, sync_period=10, full_rank_steps=2, sync_rule="qsr", alpha=0.3, h_base=6,
            rank_cutoff=0.4, min_compression_rate=0.0)


def lr_of_step(t):
    if t < LR_WARMUP:
        return PEAK * (t + 1) / LR_WARMUP
    return PEAK * 0.5 * (1.0 + math.cos(math.pi * (t - LR_WARMUP) / (TOTAL - LR_WARMUP)))


def expected_phases(total, warmup, period, full, alpha, h_base, power=2.0, cap=None):
    """Written from the issue: warm-up as in AB (first phase ends at the first multiple of P);
    after each sync, F full-rank steps, then an AB phase of H - F steps, H = max(h_base,
    floor((alpha/lr)^power)) from the lr at the phase's start, capped by the remaining steps."""
    out, t = [], 0
    while t < total and t < warmup:
        out.append("warmup")
        t += 1
    first_end = (warmup // period + 1) * period
    while t < min(first_end, total):
        out.append("ab")
        t += 1
    while t < total:
        for _ in range(full):
            if t < total:
                out.append("full")
                t += 1
        if t >= total:
            break
        h = max(h_base, math.floor((alpha / lr_of_step(t)) ** power))
        length = h - full if cap is None else min(h - full, cap - t)
        for _ in range(max(1, length)):
            if t < total:
                out.append("ab")
                t += 1
    return out


def test_schedule_follows_the_rule_on_a_cosine():
    conf = ABConfig(**RULE)
    expected = expected_phases(TOTAL, 12, 10, 2, 0.3, 6)
    assert phases(TOTAL, conf, lr_of_step) == expected
    # the rule really stretched the phases as the lr decayed
    runs, last = [], None
    for p in expected:
        if p == "ab" and last != "ab":
            runs.append(0)
        if p == "ab":
            runs[-1] += 1
        last = p
    assert runs[0] == 8 and max(runs) > 3 * runs[1], runs  # first phase as in AB, then longer as the lr decays


def test_capped_by_total_steps_and_alpha_zero_is_plain():
    capped = ABConfig(**{**RULE, "total_steps": TOTAL})
    assert phases(TOTAL, capped, lr_of_step) == expected_phases(TOTAL, 12, 10, 2, 0.3, 6, cap=TOTAL)
    plain = ABConfig(warmup_steps=12, sync_period=10, full_rank_steps=2)
    tiny = ABConfig(warmup_steps=12, sync_period=10, full_rank_steps=2, sync_rule="qsr", alpha=1e-9)
    assert phases(TOTAL, tiny, lr_of_step) == phases(TOTAL, plain)
    # alpha 0 with h_base = sync_period is plain AB exactly, so the key that asks for the rule changes nothing
    with pytest.raises(ConfigError, match=r"ab\.sync_rule 'qsr' has no effect here: it acts only with alpha > 0"):
        ABConfig(warmup_steps=12, sync_period=10, full_rank_steps=2, sync_rule="qsr", alpha=0.0)


def test_rule_settings_are_checked():
    with pytest.raises(ConfigError, match=r"ab\.h_base must be > ab\.full_rank_steps with sync_rule 'qsr'"):
        ABConfig(sync_rule="qsr", h_base=2, full_rank_steps=2)
    with pytest.raises(ConfigError, match=r"ab\.sync_rule must be one of 'fixed', 'qsr'"):
        ABConfig(sync_rule="quadratic")
    with pytest.raises(ConfigError, match=r"ab\.alpha must be >= 0"):
        ABConfig(alpha=-1)


def _cosine_run(rank, world, settings):
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), lr=PEAK, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_of_step(t) / PEAK)
    state = commhooks.ABState(opt, model=net, **settings)
    net.register_comm_hook(state, commhooks.ab_hook)
    seen = []
    for step in range(TOTAL):
        seen.append(state.phase)
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        sched.step()
    return seen, state.syncs


def test_hook_follows_the_rule_with_the_lr_each_phase_starts_with():
    for settings in ({**RULE, "group_size": 1}, {**RULE, "mode": "only-b", "local_group_steps": True}):
        for seen, syncs in run_ranks(_cosine_run, 2, settings=settings):
            assert seen == expected_phases(TOTAL, 12, 10, 2, 0.3, 6)
            assert syncs == sum(1 for a, b in zip(seen, seen[1:]) if a == "ab" and b == "full")


def _plain_vs_zero_alpha(rank, world, extra):
    out = []
    for rule in ({}, {"sync_rule": "qsr", "alpha": 1e-9}):  # the rule's periods never above h_base: plain AB
        net = DDP(mlp())
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        state = commhooks.ABState(opt, model=net, warmup_steps=5, sync_period=6, full_rank_steps=2, rank_cutoff=0.4,
                                  min_compression_rate=0.0, **extra, **rule)
        net.register_comm_hook(state, commhooks.ab_hook)
        for step in range(26):
            x, y = batch(step, rank)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        out.append((weights(net.module), state.syncs, state.meter.bytes()))
    return out


@pytest.mark.parametrize("extra", [{"group_size": 1, "sync": "with-stale"}, {"mode": "only-b"}], ids=["groups", "only-b"])
def test_alpha_zero_equals_plain_ab(extra):
    for (w_plain, s_plain, b_plain), (w_rule, s_rule, b_rule) in run_ranks(_plain_vs_zero_alpha, 2, extra=extra):
        assert s_plain == s_rule == 4 and b_plain == b_rule
        for n in w_plain:
            assert torch.allclose(w_plain[n], w_rule[n], atol=1e-6), n


def _local_group_steps(rank, world):
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    state = commhooks.ABState(opt, model=net, warmup_steps=2, sync_period=8, full_rank_steps=1, mode="only-b",
                              local_group_steps=True, rank_cutoff=0.4, min_compression_rate=0.0)
    net.register_comm_hook(state, commhooks.ab_hook)
    snaps = []
    for step in range(10):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        snaps.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    return state.meter.by_tag(), snaps


def test_local_group_steps_send_nothing_inside_the_group():
    (tags0, s0), (tags1, s1) = run_ranks(_local_group_steps, 2)
    assert "ab-grad" not in tags0 and tags0["sync"] > 0
    assert not torch.equal(s0[4], s1[4])  # the whole world is one only-b group, yet it trained locally
    assert torch.equal(s0[7], s1[7])  # synced before step 8


def train(args, tmp_path, name):
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "commhooks.tools.train",
         "--no-progress", "--json-out", str(out), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_fewer_bytes_than_ab_and_qsr_alone_on_mnist1d(tmp_path):
    """The benchmark's MNIST-1D setting (the demo's schedule), 1200 steps: bytes only, accuracy is in the README."""
    ab = train(["--hook", "ab", "--config", "configs/ab_mnist1d.json"], tmp_path, "ab")
    qsr = train(["--hook", "qsr", "--config", "configs/qsr_mnist1d.json"], tmp_path, "qsr")
    both = train(["--hook", "ab", "--config", "configs/abqsr_mnist1d.json"], tmp_path, "abqsr")
    assert both["config"]["sync_rule"] == "qsr"
    assert both["bytes_per_rank"] < qsr["bytes_per_rank"] < ab["bytes_per_rank"], (both, qsr, ab)


def _payload_run(rank, world, codec, resume_at=None):
    """AB x QSR (groups of one rank, with-stale) for 30 steps; ``resume_at``: save there, rebuild, load, go on."""
    settings = dict(warmup_steps=5, sync_period=6, full_rank_steps=2, rank_cutoff=0.4, min_compression_rate=0.0,
                    group_size=1, sync="with-stale", sync_rule="qsr", alpha=1e-9, payload=codec)

    def build():
        net = DDP(mlp())
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        state = commhooks.ABState(opt, model=net, **settings)
        net.register_comm_hook(state, commhooks.ab_hook)
        return net, opt, state

    net, opt, state = build()
    after_sync = []
    for step in range(30):
        if step == resume_at:
            saved = ({k: v.clone() for k, v in net.module.state_dict().items()}, opt.state_dict(), state.state_dict())
            net, opt, state = build()
            net.module.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        syncs = state.syncs
        opt.step()
        if state.syncs > syncs:
            after_sync.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
    return weights(net.module), state.meter.by_tag(), state.syncs, after_sync


def _payloads(rank, world):
    return {codec: _payload_run(rank, world, codec) for codec in ("fp32", "int8")} | {
        "resumed": _payload_run(rank, world, "int8", resume_at=9)}  # mid-phase: the entry reference is restored


def test_ab_sync_sends_compressed_changes_since_the_phase_began():
    r0, r1 = run_ranks(_payloads, 2)
    for r in (r0, r1):
        (w32, tags32, s32, _), (w8, tags8, s8, _) = r["fp32"], r["int8"]
        assert s32 == s8 == 5
        assert tags8["sync"] < tags32["sync"] / 3  # 1 byte and a scale per 256 against 4 bytes per element
        # what int8 lost at five syncs stays small: every weight within 2 % of the weights' range of fp32's
        for n in w32:
            spread = float(w32[n].max() - w32[n].min())
            assert float((w8[n] - w32[n]).abs().max()) < 0.02 * spread, n
            assert not torch.equal(w8[n], w32[n]) or w8[n].ndim < 2  # the codec really ran
        resumed = r["resumed"][0]
        assert all(torch.equal(w8[n], resumed[n]) for n in w8)
    for a, b in zip(r0["int8"][3], r1["int8"][3]):  # every rank decoded the same mean: identical after each sync
        assert torch.equal(a, b)
