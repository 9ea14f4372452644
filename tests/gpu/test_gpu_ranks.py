"""Several ranks on the one lent GPU (``cuda:gloo``: NCCL refuses two ranks on one device, and ``cuda:gloo``
refuses CPU tensors as NCCL does), every algorithm path, each matching the same run on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import commhooks
from tests.devicecheck import StrictDevices
from tests.dist import run_ranks
from tests.gpu.common import TARGET, batch, ddp, local_device, model, record

STEPS = 10
AB = {"type": "ab", "warmup_steps": 2, "sync_period": 5, "full_rank_steps": 1, "group_size": 1,
      "min_compression_rate": 1.01, "rank_cutoff": 0.8}
TWO_RANKS = {
    "qsr": {"type": "qsr", "h_base": 3, "total_steps": STEPS},
    "qsr-outer-int8-ef-overlap2-fragments2": {"type": "qsr", "h_base": 4, "outer_lr": 0.7, "outer_momentum": 0.9,
                                              "payload": "int8", "error_feedback": True, "overlap_steps": 2,
                                              "fragments": 2, "total_steps": STEPS},
    "ab": AB,
    "ab-x-qsr-int8": {**AB, "sync_rule": "qsr", "h_base": 3, "sync_period": 4, "payload": "int8"},
}
FOUR_RANKS = {  # replica groups of 2 (a node's GPUs), hierarchical syncs across them
    "qsr-replicas-hierarchical-int8-ef-overlap2-fragments2": {
        "type": "qsr", "group_size": 2, "hierarchical": True, "h_base": 4, "outer_lr": 0.7, "outer_momentum": 0.9,
        "payload": "int8", "error_feedback": True, "overlap_steps": 2, "fragments": 2, "total_steps": STEPS},
}
LOOSE = 2e-2  # int8 codes and SVD bases may round differently on the GPU: a bound, not bit equality


def _cases(rank, world, on_target, cases):
    device = local_device() if on_target else torch.device("cpu")
    out = {}
    with StrictDevices():  # any library tensor made without device= fails the run here too
        for name, conf in cases.items():
            net = ddp(model(), device)
            opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
            state = commhooks.ddp.register(net, opt, conf)
            for step in range(STEPS):
                x, y = batch(step, rank, device)
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                opt.step()
            if conf["type"] == "ab":
                state.sync()  # AB's run is cut mid-phase: end synced, to compare ranks
            out[name] = {"params": {n: p.detach().to("cpu") for n, p in net.module.named_parameters()},
                         "syncs": state.syncs, "step": state.step, "devices": sorted({str(p.device) for p in
                                                                                      net.module.parameters()})}
    return out


def _compare(on_target, on_cpu, world):
    figures = {}
    for name in on_target[0]:
        t0, c0 = on_target[0][name], on_cpu[0][name]
        assert t0["devices"] == ([f"{TARGET.device}:0"] if TARGET.device == "cuda" else ["cpu"]), t0["devices"]
        for r in range(1, world):  # ranks end identical (synced end)
            for n, p in t0["params"].items():
                assert torch.equal(p, on_target[r][name]["params"][n]), (name, r, n)
        assert (t0["syncs"], t0["step"]) == (c0["syncs"], c0["step"]), (name, t0["syncs"], c0["syncs"])
        diff = max(float((p - c0["params"][n]).abs().max()) for n, p in t0["params"].items())
        assert diff < LOOSE, (name, diff)
        figures[name] = {"syncs": t0["syncs"], "max_abs_diff_vs_cpu": diff}
    return figures


def test_two_ranks_on_one_device_match_the_cpu():
    on_target = run_ranks(_cases, 2, timeout=300, backend=TARGET.backend, on_target=True, cases=TWO_RANKS)
    on_cpu = run_ranks(_cases, 2, timeout=300, on_target=False, cases=TWO_RANKS)
    record("two ranks on one device vs CPU", _compare(on_target, on_cpu, 2))


def test_four_ranks_replica_groups_hierarchical_match_the_cpu():
    on_target = run_ranks(_cases, 4, timeout=400, backend=TARGET.backend, on_target=True, cases=FOUR_RANKS)
    on_cpu = run_ranks(_cases, 4, timeout=400, on_target=False, cases=FOUR_RANKS)
    record("four ranks, replica groups, hierarchical vs CPU", _compare(on_target, on_cpu, 4))


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
    return {"params": {n: p.detach().to("cpu") for n, p in net.module.named_parameters()}, "step": state.step,
            "skipped": state.skipped_steps, "scale": float(scaler.get_scale()), "syncs": state.syncs}


def test_grad_scaler_with_an_inf_on_one_rank_keeps_the_schedule():
    r0, r1 = run_ranks(_grad_scaler, 2, timeout=300, backend=TARGET.backend, on_target=True)
    assert r0["step"] == r1["step"] == 9 and r0["syncs"] == r1["syncs"] == 3, (r0, r1)
    assert (r0["skipped"], r1["skipped"]) == (0, 1), (r0["skipped"], r1["skipped"])
    assert r0["scale"] == r1["scale"], (r0["scale"], r1["scale"])
    for n, p in r0["params"].items():
        assert torch.equal(p, r1["params"][n]), n
    record("GradScaler with an Inf on rank 1", {"skipped": [r0["skipped"], r1["skipped"]], "scale": r0["scale"]})
