"""QSR local SGD through the DDP adapter, on 2 real gloo ranks."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.algorithms.contract import STEP_PROOF_BYTES
from commhooks.config import QSRConfig
from commhooks.algorithms.qsr import qsr_period
from tests.declared import declared
from tests.dist import run_ranks

IN, OUT = 8, 4


def small_model(batchnorm: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(IN, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Linear(16, OUT)]
    return nn.Sequential(*layers)


def batch(step: int, rank: int, same_data: bool = False):
    g = torch.Generator().manual_seed(1000 * step + (0 if same_data else rank))
    return torch.randn(16, IN, generator=g), torch.randint(0, OUT, (16,), generator=g)


def local_ddp(model: nn.Module) -> DDP:
    return DDP(model, forward_sync_buffers=False)


def flat_state(model: nn.Module) -> torch.Tensor:
    """Parameters and float buffers of the model, as one vector."""
    ts = [p.detach() for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
    return torch.cat([t.reshape(-1) for t in ts]).clone()


def sgd_step(net, optimizer, step, rank, scheduler=None, same_data=False):
    x, y = batch(step, rank, same_data)
    optimizer.zero_grad()
    F.cross_entropy(net(x), y).backward()
    optimizer.step()
    if scheduler is not None:
        scheduler.step()


# --------------------------------------------------------------------------
# the rule itself (single process)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("power", [1.0, 2.0, 3.0])
def test_rule_formula(power):
    conf = QSRConfig(alpha=0.1, h_base=2, power=power, warmup_steps=5, init_h=3)
    assert qsr_period(0, 1e-6, conf) == 3 and qsr_period(4, 1e-6, conf) == 3  # warm-up: init_h
    for lr in (0.5, 0.1, 0.05, 0.013, 0.001):
        assert qsr_period(10, lr, conf) == max(2, math.floor((0.1 / lr) ** power))


def test_rule_edges():
    assert qsr_period(0, 0.1, QSRConfig(alpha=0.0, h_base=7)) == 7  # alpha 0: constant H
    capped = QSRConfig(alpha=1.0, h_base=2, total_steps=100)
    assert qsr_period(90, 0.01, capped) == 10  # capped at the remaining steps
    assert qsr_period(100, 0.01, capped) == 1  # never below 1
    assert qsr_period(0, 0.0, capped) == 100  # lr 0: sync only at the end
    assert qsr_period(0, 0.0, QSRConfig(alpha=1.0)) > 10**9  # ... or never, without total_steps
    assert qsr_period(0, 0.1, QSRConfig(h_base=4)) == 4  # default warm-up period is h_base


# --------------------------------------------------------------------------
# multi-rank behaviour
# --------------------------------------------------------------------------


def _h1_vs_ddp(rank, world, steps):
    ref = DDP(small_model(False))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    qsr = local_ddp(small_model(False))
    qsr_opt = torch.optim.SGD(qsr.parameters(), lr=0.1)
    state = commhooks.QSRState(qsr_opt, model=qsr, alpha=0.0, h_base=1)
    qsr.register_comm_hook(state, commhooks.qsr_hook)
    for step in range(steps):
        sgd_step(ref, ref_opt, step, rank)
        sgd_step(qsr, qsr_opt, step, rank)
    return flat_state(ref.module), flat_state(qsr.module), state.syncs


def test_h1_plain_sgd_equals_ddp_allreduce():
    results = run_ranks(_h1_vs_ddp, 2, steps=20)
    for ref, qsr, syncs in results:
        assert syncs == 20
        assert torch.allclose(ref, qsr, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(results[0][0], flat_state(small_model(False)))  # it trained


def lr_of_step(t, peak, warmup, total):
    """Linear warm-up then cosine to zero, written out independently of LambdaLR."""
    if t < warmup:
        return peak * (t + 1) / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (total - warmup)))


def expected_sync_steps(total, peak, warmup, alpha, h_base, qsr_warmup, init_h):
    out, t = [], 0
    while t < total:
        lr = lr_of_step(t, peak, warmup, total)
        if t < qsr_warmup:
            h = init_h
        else:
            h = max(1, min(total - t, max(h_base, math.floor((alpha / lr) ** 2))))
        t += h
        out.append(t)
    return out


def _cosine_run(rank, world, total, peak, warmup, alpha, h_base, init_h):
    net = local_ddp(small_model(True))
    opt = torch.optim.SGD(net.parameters(), lr=peak, momentum=0.9)

    def factor(t):
        if t < warmup:
            return (t + 1) / warmup
        return 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    state = commhooks.QSRState(
        opt, model=net, alpha=alpha, h_base=h_base, warmup_steps=warmup, init_h=init_h, total_steps=total
    )
    net.register_comm_hook(state, commhooks.qsr_hook)
    for step in range(total):
        sgd_step(net, opt, step, rank, sched)
    return state.sync_steps, state.step


def test_sync_steps_follow_the_rule_on_a_cosine_schedule():
    kw = dict(total=300, peak=0.1, warmup=20, alpha=0.15, h_base=2, init_h=1)
    expected = expected_sync_steps(kw["total"], kw["peak"], kw["warmup"], kw["alpha"], kw["h_base"], kw["warmup"], kw["init_h"])
    assert expected[:20] == list(range(1, 21))  # warm-up syncs every step
    assert expected[-1] == 300 and len(expected) < 300 // 2  # thins out, ends synced
    gaps = [b - a for a, b in zip(expected, expected[1:])]
    assert max(gaps) > 10  # the quadratic rule really grew H
    for sync_steps, steps in run_ranks(_cosine_run, 2, **kw):
        assert steps == 300
        assert sync_steps == expected


def _sync_consistency(rank, world, steps, h_base):
    net = local_ddp(small_model(True))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = commhooks.QSRState(opt, model=net, alpha=0.0, h_base=h_base)
    net.register_comm_hook(state, commhooks.qsr_hook)
    n_params = sum(p.numel() for p in net.parameters())
    n_float_buffers = sum(b.numel() for b in net.module.buffers() if b.is_floating_point())
    snaps, byte_deltas, call_deltas, synced = [], [], [], []
    for step in range(steps):
        b0, c0, s0 = state.meter.bytes(), state.meter.calls(), state.syncs
        sgd_step(net, opt, step, rank)
        snaps.append(flat_state(net.module))
        byte_deltas.append(state.meter.bytes() - b0)
        call_deltas.append(state.meter.calls() - c0)
        synced.append(state.syncs > s0)
    return dict(snaps=snaps, bytes=byte_deltas, calls=call_deltas, synced=synced,
                n_params=n_params, n_float_buffers=n_float_buffers)


def test_identical_after_sync_divergent_between_and_metered():
    r0, r1 = run_ranks(_sync_consistency, 2, steps=12, h_base=3)
    assert r0["synced"] == [(s + 1) % 3 == 0 for s in range(12)]
    traffic = declared({"type": "qsr", "alpha": 0.0, "h_base": 3}, small_model(True))
    assert traffic.sync_steps == [3, 6, 9, 12] and traffic.sync == ((  # one call: parameters, buffers, the proof
        commhooks.algorithms.traffic.Send("allreduce", (r0["n_params"] + 32) * 4 + STEP_PROOF_BYTES, "sync"),))
    assert r0["n_float_buffers"] == 32  # BatchNorm running mean and var; num_batches_tracked is left alone
    for step in range(12):
        a, b = r0["snaps"][step], r1["snaps"][step]
        assert r0["bytes"][step] == traffic.bytes_at(step + 1) and r0["calls"][step] == len(traffic.timeline[step])
        if r0["synced"][step]:
            assert torch.equal(a, b), f"ranks differ right after the sync at step {step}"
        else:
            assert not torch.allclose(a, b), f"ranks identical between syncs at step {step} (different data)"
            assert r0["bytes"][step] == 0 and r0["calls"][step] == 0, "gradient traffic between syncs"


def _accumulation(rank, world, steps, micro):
    net = local_ddp(small_model(False))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    state = commhooks.ddp.register(net, opt, {"type": "qsr", "h_base": 2})
    for step in range(steps):
        for m in range(micro):
            x, y = batch(step * micro + m, rank)
            if m < micro - 1:
                with net.no_sync():
                    F.cross_entropy(net(x), y).backward()
            else:
                F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return state.step, state.syncs


def test_no_sync_accumulation_counts_optimizer_steps():
    for step, syncs in run_ranks(_accumulation, 2, steps=6, micro=3):
        assert (step, syncs) == (6, 3)


def _broadcast_buffers_warning(rank, world):
    net = DDP(small_model(True))  # default: buffers re-broadcast on every forward
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        commhooks.QSRState(opt, model=net, h_base=2)
    quiet = local_ddp(small_model(True))
    with warnings.catch_warnings(record=True) as caught_quiet:
        warnings.simplefilter("always")
        commhooks.QSRState(torch.optim.SGD(quiet.parameters(), lr=0.1), model=quiet, h_base=2)
    return [str(w.message) for w in caught], [str(w.message) for w in caught_quiet]


def test_broadcast_buffers_warns():
    for loud, quiet in run_ranks(_broadcast_buffers_warning, 2):
        assert any("forward_sync_buffers" in m for m in loud)
        assert not any("forward_sync_buffers" in m for m in quiet)


# --------------------------------------------------------------------------
# checkpoint / resume
# --------------------------------------------------------------------------


def _resumable(rank, world, total, stop_at=None, resume_dir=None, save_dir=None):
    net = local_ddp(small_model(True))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, total)
    state = commhooks.QSRState(opt, model=net, alpha=0.05, h_base=2, total_steps=total)
    net.register_comm_hook(state, commhooks.qsr_hook)
    start = 0
    if resume_dir is not None:
        ck = torch.load(f"{resume_dir}/rank{rank}.pt", weights_only=False)
        net.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        state.load_state_dict(ck["qsr"])
        start = state.step
    for step in range(start, total if stop_at is None else stop_at):
        sgd_step(net, opt, step, rank, sched)
    if save_dir is not None:
        torch.save(
            {"model": net.module.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "qsr": state.state_dict()},
            f"{save_dir}/rank{rank}.pt",
        )
    return flat_state(net.module), state.state_dict(), state.sync_steps


def test_checkpoint_resume_is_exact(tmp_path):
    total = 40
    full = run_ranks(_resumable, 2, total=total)
    first = run_ranks(_resumable, 2, total=total, stop_at=17, save_dir=str(tmp_path))
    assert first[0][1]["since_sync"] != 0, "pick a stop step inside a round"
    resumed = run_ranks(_resumable, 2, total=total, resume_dir=str(tmp_path))
    for rank in range(2):
        assert torch.equal(full[rank][0], resumed[rank][0]), f"rank {rank} diverged after resume"
        assert full[rank][1] == resumed[rank][1]
        assert full[rank][2] == first[rank][2] + resumed[rank][2]


# --------------------------------------------------------------------------
# replica groups: every step inside a group, by the rule across groups
# --------------------------------------------------------------------------


def _replica_groups(rank, world, steps, h_base, extra=None):
    import torch.distributed as dist

    torch.manual_seed(0)
    base = small_model(False)
    # commhooks: QSR with replica groups of 2
    net = local_ddp(copy_model(base))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = commhooks.ddp.register(net, opt, {"type": "qsr", "h_base": h_base, "group_size": 2, "check_every": 1,
                                              **(extra or {})})
    # the reference, written here: allreduce inside the pair every step, world average every h_base steps
    ref = copy_model(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    per_step, synced, inside, across, by_tag = [], [], [], [], []
    for step in range(steps):
        b0 = state.meter.bytes()
        t0 = dict(state.meter.by_tag())
        sgd_step(net, opt, step, rank)
        x, y = batch(step, rank)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad, group=pair)
            p.grad /= 2
        ref_opt.step()
        if (step + 1) % h_base == 0:
            for p in ref.parameters():
                dist.all_reduce(p.data)
                p.data /= world
        per_step.append(state.meter.bytes() - b0)
        by_tag.append({k: v - t0.get(k, 0) for k, v in state.meter.by_tag().items() if v - t0.get(k, 0)})
        synced.append(state.syncs)
        mine = flat_state(net.module)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        inside.append(torch.equal(gathered[0], gathered[1]) and torch.equal(gathered[2], gathered[3]))
        across.append(torch.equal(gathered[0], gathered[2]))
    numel = sum(p.numel() for p in ref.parameters())
    return flat_state(net.module), flat_state(ref), per_step, synced, inside, across, numel, by_tag


def copy_model(model):
    import copy

    return copy.deepcopy(model)


def test_replica_groups_equal_a_reference_and_meter_their_traffic():
    results = run_ranks(_replica_groups, 4, timeout=180, steps=9, h_base=3)
    for mine, ref, per_step, synced, inside, across, numel, _ in results:
        assert torch.allclose(mine, ref, atol=1e-6), (mine - ref).abs().max()
        assert all(inside), "the ranks of a replica group hold the same parameters at every step"
        assert across == [(s + 1) % 3 == 0 for s in range(9)], "groups differ between syncs, agree after"
        traffic = declared({"type": "qsr", "h_base": 3, "group_size": 2}, small_model(False), world=4, steps=9)
        assert traffic.step == (commhooks.algorithms.traffic.Send("allreduce", 4 * numel, "group-grad", "group"),)
        assert traffic.sync_steps == [3, 6, 9]
        assert per_step == [traffic.bytes_at(s + 1) for s in range(9)]  # a group-grad payload every step, syncs


def test_hierarchical_replica_sync_is_the_same_sync_with_half_the_traffic_across_groups():
    """hierarchical: each rank of a pair syncs its half of the parameters with the other pair's same half, then
    the pair shares its halves: the reference's weights with half the payload across groups (the other half
    shared inside the pair); on the outer-step path (Nesterov, bf16, overlapped) the same weights as without it."""
    results = run_ranks(_replica_groups, 4, timeout=180, steps=9, h_base=3, extra={"hierarchical": True})
    for rank, (mine, ref, per_step, synced, inside, across, numel, by_tag) in enumerate(results):
        assert torch.allclose(mine, ref, atol=1e-6), (mine - ref).abs().max()
        assert all(inside) and across == [(s + 1) % 3 == 0 for s in range(9)]
        half = numel // 2 if rank % 2 == 0 else numel - numel // 2  # the pair's first rank holds the first half
        traffic = declared({"type": "qsr", "h_base": 3, "group_size": 2, "hierarchical": True}, small_model(False),
                           world=4, steps=9, rank=rank)
        assert traffic.sync == tuple(commhooks.algorithms.traffic.Send(kind, b, tag, scope) for kind, b, tag, scope in (
            ("allreduce", 4 * half + STEP_PROOF_BYTES, "sync", "across"),
            ("broadcast", 4 * half, "share-part", "group")))
        assert by_tag == [traffic.at(step + 1) for step in range(9)]  # share-part: counted at its source
    # (the flat sync's world of 4 would take the two-step exchange, which rounds the mean a second time: the
    # allgather keeps both on one rounding, as the hierarchical sync's 2-rank groups are)
    outer = {"outer_lr": 0.7, "outer_momentum": 0.9, "payload": "bf16", "overlap_steps": 1,
             "payload_exchange": "allgather"}
    flat = run_ranks(_replica_groups, 4, timeout=180, steps=9, h_base=3, extra=outer)
    hier = run_ranks(_replica_groups, 4, timeout=180, steps=9, h_base=3, extra={**outer, "hierarchical": True})
    for rank, (a, b) in enumerate(zip(flat, hier)):
        assert torch.allclose(a[0], b[0], atol=1e-6), (rank, (a[0] - b[0]).abs().max())
        assert all(b[4]), "the pair holds the same weights at every step"
        sent = [sum(t.get("sync", 0) for t in r[7]) for r in (a, b)]
        syncs = sum(1 for t in b[7] if "sync" in t)
        half = b[6] // 2 if rank % 2 == 0 else b[6] - b[6] // 2
        assert syncs == 3 and sent[0] - sent[1] == syncs * 2 * (b[6] - half), sent  # bf16: the other half unsent
        # the pair shares its fp32 halves after each landed sync (steps 4 and 7; the one sent at step 9 is still in
        # flight); not after the anchor: the ranks start equal (DDP), so each keeps its own weights as the anchor
        assert [k for k, t in enumerate(b[7]) if "share-part" in t] == [3, 6], b[7]
        for hierarchical, r in ((False, a), (True, b)):
            traffic = declared({"type": "qsr", "h_base": 3, "group_size": 2, **outer, "hierarchical": hierarchical},
                               small_model(False), world=4, steps=9, rank=rank)
            assert r[7] == [traffic.at(step + 1) for step in range(9)], (hierarchical, r[7])
