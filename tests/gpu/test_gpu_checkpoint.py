"""Checkpoint round trips on the device over NCCL (2 ranks on the one GPU), mid-AB-phase and mid-overlap (a sync
in flight), with dropout: the checkpoint is loaded into a fresh model, optimizer and state, with the RNGs moved
on, and the resumed run must end bit-exact with the uninterrupted one: only if the CUDA RNG (dropout masks) and
every tensor the state holds come back on the device.  The commit itself now waits on the host for every
rank's file (an NCCL barrier alone does not hold the host)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.nn.functional as F

import commhooks
from tests.dist import run_ranks
from tests.gpu.common import ENV, TARGET, batch, ddp, deterministic, local_device, model, rank_env, record

CASES = {
    "ab-mid-phase": ({"type": "ab", "warmup_steps": 2, "sync_period": 6, "full_rank_steps": 1, "group_size": 1,
                      "min_compression_rate": 1.01, "rank_cutoff": 0.8}, 4),
    "qsr-mid-overlap": ({"type": "qsr", "h_base": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "payload": "int8",
                         "error_feedback": True, "overlap_steps": 2, "fragments": 2, "total_steps": 12}, 6),
}
STEPS = 10


def _run(net, opt, rank, device, first, last):
    for step in range(first, last):
        x, y = batch(step, rank, device)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


def _round_trip(rank, world, conf, save_at, directory):
    deterministic()
    device = local_device()
    torch.manual_seed(1234 + rank)
    if device.type == "cuda":
        torch.cuda.manual_seed(1234 + rank)
    net = ddp(model(dropout=0.3), device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = commhooks.ddp.register(net, opt, conf)
    _run(net, opt, rank, device, 0, save_at)
    in_flight = bool(getattr(state, "driver", None) and state.driver.in_flight)
    phase = getattr(state, "phase", None)
    commhooks.save_checkpoint(directory, net, opt, state)
    _run(net, opt, rank, device, save_at, STEPS)
    straight = {n: p.detach().to("cpu") for n, p in net.module.named_parameters()}
    # a fresh model, optimizer and state, and RNGs moved on: everything must come back from the checkpoint
    torch.manual_seed(999)
    if device.type == "cuda":
        torch.cuda.manual_seed(999)
    net2 = ddp(model(dropout=0.3), device)
    opt2 = torch.optim.SGD(net2.parameters(), lr=0.05, momentum=0.9)
    state2 = commhooks.ddp.register(net2, opt2, conf)
    commhooks.load_checkpoint(directory, net2, opt2, state2)
    _run(net2, opt2, rank, device, save_at, STEPS)
    resumed = {n: p.detach().to("cpu") for n, p in net2.module.named_parameters()}
    worst = max(float((straight[n] - resumed[n]).abs().max()) for n in straight)
    return {"in_flight": in_flight, "phase": phase, "max_abs_diff": worst, "device": str(device)}


def _env(rank):
    return {**ENV, **rank_env(rank)}  # cuBLAS's deterministic mode in CPU mode too (rank_env adds it on CUDA)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_round_trip_on_the_device_is_exact(case):
    conf, save_at = CASES[case]
    with tempfile.TemporaryDirectory() as d:
        results = run_ranks(_round_trip, 2, timeout=240, backend=TARGET.backend, env=_env,
                            device_id=TARGET.device_id, conf=conf, save_at=save_at, directory=d)
    for r in results:
        assert r["max_abs_diff"] == 0.0, r
    if case == "qsr-mid-overlap":
        assert all(r["in_flight"] for r in results), results
    else:
        assert all(r["phase"] == "ab" for r in results), results
    record(f"checkpoint round trip {case}", results[0])
