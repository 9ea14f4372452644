"""Several ranks on the one lent GPU over real NCCL (each rank claims a host of its own: common.nccl_one_gpu_env;
eager initialisation with ``device_id``, so replica and hierarchical groups are split from the world's
communicator), every algorithm path, each against the same run on the CPU with a tolerance per case
(common.Tolerance says why each is what it is).  What runs together here for the first time: ``ReduceOp.AVG``,
CUDA-future callbacks (AB's projection), ``all_to_all_single`` (the two-step compressed mean, the default from
3 ranks), communicator splits, and NCCL's waits that do not hold the host."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import commhooks
from tests.devicecheck import StrictDevices
from tests.dist import run_ranks
from tests.gpu.common import (FP32, INT2, INT8, LOWRANK, TARGET, batch, compare_to_cpu, ddp, deterministic,
                              local_device, model, params_cpu, rank_env, record)

STEPS = 10
AB = {"type": "ab", "warmup_steps": 2, "sync_period": 5, "full_rank_steps": 1, "group_size": 1,
      "min_compression_rate": 1.01, "rank_cutoff": 0.8, "total_steps": STEPS}
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "error_feedback": True}
# name: (config, ranks, tolerance)
CASES = {
    "qsr": ({"type": "qsr", "h_base": 3, "total_steps": STEPS}, 2, FP32),
    "qsr-outer-int8-overlap1-fragments2": ({"type": "qsr", "h_base": 4, **OUTER, "payload": "int8",
                                            "overlap_steps": 1, "fragments": 2, "total_steps": STEPS}, 2, INT8),
    "ab": (AB, 2, LOWRANK),
    "ab-x-qsr-int8": ({**AB, "sync_rule": "qsr", "h_base": 3, "sync_period": 4, "payload": "int8"}, 2, INT8),
    "qsr-outer-int2-two-step-3-ranks": ({"type": "qsr", "h_base": 3, **OUTER, "payload": "int2",
                                         "payload_exchange": "two_step", "total_steps": STEPS}, 3, INT2),
    # replica groups of 2 (a node's GPUs), hierarchical syncs across them
    "qsr-replicas-hierarchical-outer-int8-overlap1-fragments2": (
        {"type": "qsr", "group_size": 2, "hierarchical": True, "h_base": 4, **OUTER, "payload": "int8",
         "overlap_steps": 1, "fragments": 2, "total_steps": STEPS}, 4, INT8),
}


def _cases(rank, world, on_target, names):
    deterministic()
    device = local_device() if on_target else torch.device("cpu")
    out = {}
    with StrictDevices():  # any library tensor made without device= fails the run here too
        for name in names:
            conf = CASES[name][0]
            net = ddp(model(), device)
            start = params_cpu(net.module)
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
            state = commhooks.ddp.register(net, opt, conf)
            for step in range(STEPS):
                x, y = batch(step, rank, device)
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
            out[name] = {"start": start, "params": params_cpu(net.module), "syncs": state.syncs, "step": state.step,
                         "devices": sorted({str(p.device) for p in net.module.parameters()}),
                         "state_device": str(state.device)}
    return out


def _compare(on_target, on_cpu, world):
    figures = {}
    for name in on_target[0]:
        t0, c0 = on_target[0][name], on_cpu[0][name]
        expected = [f"{TARGET.device}:0"] if TARGET.device == "cuda" else ["cpu"]
        assert t0["devices"] == expected and t0["state_device"] == expected[0], (name, t0["devices"])
        for r in range(1, world):  # the run ends synced: every rank holds the same model, bit for bit
            for n, p in t0["params"].items():
                assert torch.equal(p, on_target[r][name]["params"][n]), (name, r, n)
        assert (t0["syncs"], t0["step"]) == (c0["syncs"], c0["step"]), (name, t0["syncs"], c0["syncs"])
        assert t0["syncs"] >= 2, (name, t0["syncs"])
        figures[name] = {"ranks": world, "syncs": t0["syncs"],
                         **compare_to_cpu(name, t0["params"], c0["params"], c0["start"], CASES[name][2])}
    return figures


def _run(world, names):
    on_target = run_ranks(_cases, world, timeout=240, backend=TARGET.backend, env=rank_env,
                          device_id=TARGET.device_id, on_target=True, names=names)
    on_cpu = run_ranks(_cases, world, timeout=240, on_target=False, names=names)
    return _compare(on_target, on_cpu, world)


def test_two_ranks_match_the_cpu():
    record(f"two ranks on one device ({TARGET.backend}) vs CPU",
           _run(2, [n for n, (_, w, _) in CASES.items() if w == 2]))


def test_three_ranks_int2_two_step_exchange_match_the_cpu():
    record(f"three ranks, int2 two-step exchange ({TARGET.backend}) vs CPU",
           _run(3, [n for n, (_, w, _) in CASES.items() if w == 3]))


def test_four_ranks_replica_groups_hierarchical_match_the_cpu():
    record(f"four ranks, replica groups, hierarchical ({TARGET.backend}) vs CPU",
           _run(4, [n for n, (_, w, _) in CASES.items() if w == 4]))


def _grad_scaler(rank, world, on_target):
    """fp16 autocast with a GradScaler; an Inf loss on rank 1 at step 3: rank 1 skips that update, every rank
    counts the step, the syncs keep the scales equal, the run ends synced."""
    device = local_device() if on_target else torch.device("cpu")
    net = ddp(model(), device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    state = commhooks.ddp.register(net, opt, {"type": "qsr", "h_base": 3, "total_steps": 9}, scaler=scaler)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16  # CPU autocast: bf16
    with StrictDevices():
        for step in range(9):
            x, y = batch(step, rank, device)
            opt.zero_grad()
            with torch.autocast(device.type, dtype=half):
                loss = F.cross_entropy(net(x), y)
            if step == 3 and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return {"params": params_cpu(net.module), "step": state.step, "skipped": state.skipped_steps,
            "scale": float(scaler.get_scale()), "syncs": state.syncs, "autocast": str(half)}


def test_grad_scaler_with_an_inf_on_one_rank_keeps_the_schedule():
    r0, r1 = run_ranks(_grad_scaler, 2, timeout=240, backend=TARGET.backend, env=rank_env,
                       device_id=TARGET.device_id, on_target=True)
    assert r0["step"] == r1["step"] == 9 and r0["syncs"] == r1["syncs"] == 3, (r0, r1)
    assert (r0["skipped"], r1["skipped"]) == (0, 1), (r0["skipped"], r1["skipped"])
    assert r0["scale"] == r1["scale"], (r0["scale"], r1["scale"])
    for n, p in r0["params"].items():
        assert torch.equal(p, r1["params"][n]), n
    assert all(torch.isfinite(p).all() for p in r0["params"].values())
    record(f"GradScaler ({r0['autocast']}) with an Inf on rank 1 ({TARGET.backend})",
           {"skipped": [r0["skipped"], r1["skipped"]], "scale": r0["scale"], "syncs": r0["syncs"]})
