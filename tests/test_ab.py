"""AB-training through the DDP adapter, on real gloo groups (2 and 4 ranks)."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.algorithms.ab import choose_rank, compression_ratio, phases, tall_view
from commhooks.algorithms.ab.groups import make_groups
from commhooks.algorithms.ab.lowrank import Basis
from commhooks.config import ABConfig, ConfigError
from tests.ab_reference import FactorReference
from tests.dist import run_ranks

IN, OUT = 12, 3
SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01)
SCHEDULE = dict(warmup_steps=4, sync_period=6, full_rank_steps=2, rank_cutoff=0.4, min_compression_rate=0.0)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, OUT))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(16, IN, generator=g), torch.randint(0, OUT, (16,), generator=g)


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def ddp_step(net, opt, step, rank):
    x, y = batch(step, rank)
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    opt.step()


# --------------------------------------------------------------------------
# single-process units: rank rule, shapes, projections, schedule, groups
# --------------------------------------------------------------------------


def with_singular_values(m, n, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, len(s), generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, len(s), generator=g))
    return u @ torch.diag(torch.tensor(s)) @ v.t()


def test_rank_follows_the_cutoff():
    s = [10.0, 5.0, 2.0, 1.6, 1.4, 0.5]
    w = with_singular_values(20, 6, s)
    assert choose_rank(torch.linalg.svdvals(w), 0.15) == 4  # 1.6 > 1.5 >= 1.4
    assert choose_rank(torch.linalg.svdvals(w), 0.45) == 2
    assert choose_rank(torch.linalg.svdvals(w), 0.99) == 1


def test_conv_weight_is_reshaped_tall_and_restored():
    w = torch.randn(8, 3, 3, 3)
    mat, transposed = tall_view(w)
    assert mat.shape == (27, 8) and transposed
    mat.mul_(0)  # a view: writes reach the conv weight
    assert w.abs().sum() == 0
    assert tall_view(torch.randn(30, 4))[0].shape == (30, 4)
    assert compression_ratio(640, 256, 20) == pytest.approx(640 * 256 / (896 * 20))


def test_factor_recovery_and_projections():
    w = with_singular_values(9, 5, [4.0, 2.0, 1.0, 0.3, 0.1])
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    k = 3
    basis = Basis(a=u[:, :k] * s[:k].sqrt(), b=s[:k].sqrt()[:, None] * vh[:k], s=s[:k])
    g = torch.randn(9, 5)
    assert basis.a_payload(g).shape == (9, 3) and basis.b_payload(g).shape == (3, 5)
    da, db = torch.randn(9, 3), torch.randn(3, 5)
    a_new, b_same = basis.factors_after(basis.dense() + da @ basis.b, "A")
    assert torch.allclose(a_new, basis.a + da, atol=1e-5) and torch.equal(b_same, basis.b)
    a_same, b_new = basis.factors_after(basis.dense() + basis.a @ db, "B")
    assert torch.allclose(b_new, basis.b + db, atol=1e-5) and torch.equal(a_same, basis.a)


def expected_phases(total, warmup, period, full):
    """The paper's schedule, step by step, written independently of commhooks.ab.schedule."""
    out, phase = [], "warmup"
    for t in range(total):
        if phase == "warmup" and t == warmup:
            phase = "ab"
        elif phase == "ab" and t % period == 0:
            phase = "full" if full else "ab"
        elif phase == "full" and t % period == full:
            phase = "ab"
        out.append(phase)
    return out


@pytest.mark.parametrize("warmup, period, full", [(4330, 759, 60), (4, 6, 2), (5, 5, 0), (0, 7, 3), (12, 6, 1)])
def test_schedule(warmup, period, full):
    total = warmup + 4 * period + 3
    conf = ABConfig(warmup_steps=warmup, sync_period=period, full_rank_steps=full)
    assert phases(total, conf) == expected_phases(total, warmup, period, full)


def test_paper_schedule_numbers():
    p = phases(4330 + 759, ABConfig())
    assert p[4329] == "warmup" and p[4330] == "ab"
    assert p[4553] == "ab" and p[4554] == "full"  # 4554 = 6 * 759: sync
    assert p[4613] == "full" and p[4614] == "ab"  # 4614 % 759 == 60: re-basis


def test_groups():
    assert make_groups(ABConfig(group_size=2), 4, 4) == ([(0, 1), (2, 3)], ["A", "B"])
    assert make_groups(ABConfig(group_size=1), 3, 3) == ([(0,), (1,), (2,)], ["A", "B", "B"])
    assert make_groups(ABConfig(group_size=-1), 8, 8)[0] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert make_groups(ABConfig(group_size=None), 8, 2)[0] == [(0, 1), (2, 3), (4, 5), (6, 7)]  # ranks per node
    assert make_groups(ABConfig(mode="only-b"), 4, 4) == ([(0, 1, 2, 3)], ["B"])
    with pytest.raises(ConfigError, match=r"ab\.group_size 2 .*ranks per node.* at least two groups"):
        make_groups(ABConfig(group_size=None), 2, 2)
    with pytest.raises(ConfigError, match=r"ab\.group_size 3 must divide the 4 ranks"):
        make_groups(ABConfig(group_size=3), 4, 4)


@pytest.mark.parametrize(
    "settings, pattern",
    [
        ({"rank_cutoff": 0.0}, r"ab\.rank_cutoff must be in \(0\.0, 1\.0\)"),
        ({"rank_cutoff": 1.5}, r"ab\.rank_cutoff must be in \(0\.0, 1\.0\)"),
        ({"sync_period": 10, "full_rank_steps": 10}, r"ab\.sync_period must be > ab\.full_rank_steps"),
        ({"mode": "only-a"}, r"ab\.mode must be one of 'groups', 'only-b'"),
        ({"sync": "stale"}, r"ab\.sync must be one of 'full', 'with-stale'"),
        ({"group_size": 0}, r"ab\.group_size must be >= 1, -1"),
        ({"full_rank": "head"}, r"ab\.full_rank must be a list"),
        ({"full_rank": ["nothing.*"]}, r"ab\.full_rank pattern 'nothing\.\*' matches no parameter"),
        ({"warmup_steps": -1}, r"ab\.warmup_steps must be >= 0"),
        ({"sync_priod": 3}, r"ABState: unknown key\(s\) 'sync_priod'"),
    ],
)
def test_bad_ab_settings_name_the_key(settings, pattern):
    model = mlp()
    with pytest.raises(ConfigError, match=pattern):  # raised before any collective: no process group needed
        commhooks.ABState(torch.optim.SGD(model.parameters(), lr=0.1), model=model, **settings)


def test_ab_state_takes_the_optimizer_first_and_the_old_order_with_a_warning():
    """Every state is built as State(optimizer, model=..., ...); ABState(model, optimizer) still works for now, with
    a DeprecationWarning, and any other positional use is a TypeError naming the right form."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(DeprecationWarning, match=r"ABState\(optimizer, model=model"):
        with pytest.raises(ConfigError, match="sync_priod"):  # the old order reached the config check
            commhooks.ABState(model, opt, sync_priod=3)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="sync_priod"):
        commhooks.ABState(model, optimizer=opt, sync_priod=3)  # the model positional, the optimizer by keyword
    with pytest.raises(TypeError, match=r"one positional argument, the optimizer"):
        commhooks.ABState(opt, model, sync_period=3)
    with pytest.raises(TypeError, match=r"the optimizer first, the model by keyword"):
        commhooks.ABState(model, opt, model=model)


# --------------------------------------------------------------------------
# equivalence with explicit factors (the paper's formulation)
# --------------------------------------------------------------------------


def _equivalence(rank, world, settings, steps):
    cfg = {**SCHEDULE, "full_rank": ["4.*"], **settings}
    cfg.setdefault("truncate_first", cfg.get("first_rank", "cut") == "cut")  # (under "full" it cannot act)
    conf = ABConfig(**cfg)
    ranks, roles = make_groups(conf, world, world)
    # the reference's own subgroups, created in the same order on every rank
    groups = [dist.new_group(list(g)) for g in ranks]
    mine = next(i for i, g in enumerate(ranks) if rank in g)
    ref = FactorReference(
        mlp(), ["0.weight", "2.weight"], roles[mine], groups[mine], len(ranks[mine]), world,
        {**cfg, "sync": conf.sync}, SGD,
    )
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), **SGD)
    state = commhooks.ABState(opt, model=net, **cfg)
    net.register_comm_hook(state, commhooks.ab_hook)
    numel = {n: p.numel() for n, p in net.module.named_parameters()}
    log = []
    for step in range(steps):
        phase, ranks_now = state.phase, dict(state.ranks)
        before = state.meter.by_tag()
        ddp_step(net, opt, step, rank)
        ref.step(*batch(step, rank))
        after = state.meter.by_tag()
        delta = {t: after.get(t, 0) - before.get(t, 0) for t in after}
        log.append((step, phase, delta, ranks_now))
        if step in (6, steps - 1):  # a full-rank step after a sync, and inside the last AB phase (no transition after)
            mine_w, ref_w = weights(net.module), ref.weights()
            for n in mine_w:
                assert torch.allclose(mine_w[n], ref_w[n], atol=2e-5, rtol=1e-4), (step, n, (mine_w[n] - ref_w[n]).abs().max())
    return {"role": state.role, "log": log, "numel": numel, "syncs": state.syncs}


def declared_ab(result, rank, world, settings, steps):
    """AB's traffic declaration for this run, given the ranks each AB phase trained at (the data decides them)."""
    from commhooks import registry
    from commhooks.algorithms.traffic import Setting

    cfg = {**SCHEDULE, "full_rank": ["4.*"], **settings}
    cfg.setdefault("truncate_first", cfg.get("first_rank", "cut") == "cut")
    conf = ABConfig(**cfg)
    entries, previous = [], None
    for _, phase, _, ranks in result["log"]:
        if phase == "ab" and previous != "ab":
            entries.append(ranks)
        previous = phase
    setting = Setting.of([(n, tuple(p.shape)) for n, p in mlp().named_parameters()], world=world, local_world=world,
                         rank=rank, steps=steps, factor_ranks=entries)
    return registry.declared_traffic(conf, setting)


@pytest.mark.parametrize(
    "world, settings",
    [
        (2, {"mode": "only-b"}),
        (4, {"mode": "groups", "group_size": 2}),
        (2, {"mode": "groups", "group_size": 1, "sync": "with-stale"}),
    ],
    ids=["only-b", "groups-4ranks", "with-stale"],
)
def test_hook_equals_explicit_factor_training(world, settings):
    results = run_ranks(_equivalence, world, timeout=240, settings=settings, steps=16)
    group_size = world if settings["mode"] == "only-b" else settings["group_size"]
    for rank, r in enumerate(results):
        assert r["syncs"] == 2
        traffic = declared_ab(r, rank, world, settings, 16)
        assert traffic.exact and traffic.sync_steps == [6, 12]
        for step, phase, delta, ranks in r["log"]:
            sent = {t: b for t, b in delta.items() if b}
            assert sent == traffic.at(step + 1), (step, phase, sent)  # the meter's bytes are the declared ones
            if phase in ("warmup", "full"):
                assert "full-grad" in sent and "ab-grad" not in sent, (step, sent)
            else:
                assert ranks["0.weight"] < 12 and ranks["2.weight"] < 8, ranks  # the cut-off truncated
                assert "full-grad" not in sent and ("ab-grad" in sent) == (group_size > 1), (step, sent)
                if group_size > 1:
                    assert sent["ab-grad"] < 4 * sum(r["numel"].values())  # factors, not weights


def test_authors_first_entry_equals_explicit_factor_training():
    """first_rank="full" (the authors' code): only-b, SGD with momentum and weight decay, through warm-up, an
    untruncated first phase, two syncs and the truncated re-bases after them, against explicit factors."""
    for r in run_ranks(_equivalence, 2, timeout=240, settings={"mode": "only-b", "first_rank": "full"}, steps=16):
        assert r["syncs"] == 2
        ab_ranks = [ranks for _, phase, _, ranks in r["log"] if phase == "ab"]
        assert ab_ranks[0] == {"0.weight": 12, "2.weight": 8}  # the first phase: every component
        assert ab_ranks[-1]["0.weight"] < 12 and ab_ranks[-1]["2.weight"] < 8  # the re-basis cut


# --------------------------------------------------------------------------
# rank agreement, conv models, consistency, state rule, resume
# --------------------------------------------------------------------------


def _rank_agreement(rank, world):
    """The ranks start equal (the state makes sure); their weights differ when the first basis is taken, one step
    later (as after a phase in which the groups trained apart): each rank's spectrum gives another rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 20, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = commhooks.ABState(opt, model=model, warmup_steps=1, sync_period=5, full_rank_steps=1, mode="only-b",
                              rank_cutoff=0.15, min_compression_rate=0.0)
    s = [10.0, 5.0, 1.0, 0.5, 0.2, 0.1] if rank == 0 else [10.0, 5.0, 2.0, 1.6, 0.2, 0.1]
    with torch.no_grad():
        model[0].weight.copy_(with_singular_values(20, 6, s, seed=rank))
    opt.zero_grad()
    (0 * model(torch.ones(1, 6)).sum()).backward()  # a step that moves nothing: the basis comes after it
    opt.step()
    b = state.bases["0.weight"]
    return state.ranks["0.weight"], b.a, b.b, state.meter.bytes(tag="basis"), model[0].weight.detach().clone()


def test_rank_is_agreed_as_the_max_and_bases_are_identical():
    (k0, a0, b0, bytes0, w0), (k1, a1, b1, bytes1, w1) = run_ranks(_rank_agreement, 2)
    assert k0 == k1 == 4  # rank 0 alone would keep 2
    assert torch.equal(a0, a1) and torch.equal(b0, b1)  # different weights: rank 0's factors were broadcast
    assert bytes0 > bytes1  # the broadcast is metered at its source


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, 24)
        self.out = nn.Linear(24, 4)

    def forward(self, x):
        return self.out(F.relu(self.fc(F.relu(self.bn(self.conv(x))).flatten(1))))


def _conv_training(rank, world, steps, bucket_view):
    net = DDP(ConvNet(), forward_sync_buffers=False, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = commhooks.ABState(opt, model=net, warmup_steps=3, sync_period=5, full_rank_steps=1, group_size=1,
                              rank_cutoff=0.5, min_compression_rate=0.0)
    net.register_comm_hook(state, commhooks.ab_hook)
    losses, params, buffers, syncs = [], [], [], []
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 3, 4, 4, generator=g), torch.randint(0, 4, (32,), generator=g)
    for step in range(steps):
        s0 = state.syncs
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        params.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]))
        buffers.append(torch.cat([net.module.bn.running_mean, net.module.bn.running_var]).clone())
        syncs.append(state.syncs > s0)
    return losses, params, buffers, syncs, state.report(), tuple(net.module.conv.weight.shape)


@pytest.mark.parametrize("bucket_view", [False, True])
def test_conv_bn_model_trains_and_is_identical_after_syncs(bucket_view):
    results = run_ranks(_conv_training, 2, steps=16, bucket_view=bucket_view)
    (l0, p0, b0, sy0, rep, shape), (l1, p1, b1, _, _, _) = results
    assert shape == (8, 3, 3, 3)
    assert l0[-1] < l0[0] and l1[-1] < l1[0]
    conv = next(layer for layer in rep["layers"] if layer["name"] == "conv.weight")
    assert conv["rank"] is not None and conv["rank"] < 8 and conv["shape"] == [8, 3, 3, 3]
    k = conv["rank"]
    assert conv["compression"] == round(27 * 8 / ((27 + 8) * k), 2)
    factored = {layer["name"]: layer for layer in rep["layers"] if layer["rank"] is not None}
    stored = rep["params_dense"] - sum(math.prod(f["shape"]) for f in factored.values())
    stored += sum((27 + 8) * f["rank"] if n == "conv.weight" else (128 + 24) * f["rank"] if n == "fc.weight"
                  else (24 + 4) * f["rank"] for n, f in factored.items())
    assert rep["params_factored"] == stored and rep["compression"] == round(rep["params_dense"] / stored, 2)
    assert sy0 == [s in (4, 9, 14) for s in range(16)]  # syncs before steps 5, 10, 15
    for step in range(16):
        if sy0[step]:
            assert torch.equal(p0[step], p1[step]) and torch.equal(b0[step], b1[step]), f"differ after sync {step}"
        elif step < 3 or step in (5, 10, 15):  # warm-up and full-rank steps: world-averaged gradients
            assert torch.equal(p0[step], p1[step]), f"parameters differ after full-rank step {step}"
        else:  # inside an AB phase the A and B ranks train different factors
            assert not torch.equal(p0[step], p1[step]), f"ranks identical in the AB phase at step {step}"


def _optimizer_state_rule(rank, world):
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = commhooks.ABState(opt, model=net, **{**SCHEDULE, "full_rank": ["4.*"]}, mode="only-b")
    net.register_comm_hook(state, commhooks.ab_hook)
    m = net.module
    seen = {}
    for step in range(8):
        ddp_step(net, opt, step, rank)
        seen[step] = {n: (p in opt.state and "momentum_buffer" in opt.state[p]) for n, p in m.named_parameters()}
    return seen


def test_optimizer_state_is_cleared_at_phase_switches():
    seen = run_ranks(_optimizer_state_rule, 2)[0]
    # after step 3 the model enters AB: compressed weights lose their momentum, dense tensors keep it
    assert seen[3] == {"0.weight": False, "0.bias": True, "2.weight": False, "2.bias": True, "4.weight": True, "4.bias": True}
    assert all(seen[4].values())
    # after step 5 the sync: every parameter starts afresh
    assert not any(seen[5].values()) and all(seen[6].values())


def _resumable(rank, world, total, stop_at=None, save_dir=None, resume_dir=None):
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), **SGD)
    state = commhooks.ABState(opt, model=net, **{**SCHEDULE, "full_rank": ["4.*"]}, group_size=1, sync="with-stale")
    net.register_comm_hook(state, commhooks.ab_hook)
    start = 0
    if resume_dir:
        ck = torch.load(f"{resume_dir}/rank{rank}.pt", weights_only=False)
        net.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        state.load_state_dict(ck["ab"])
        start = state.step
    for step in range(start, stop_at or total):
        ddp_step(net, opt, step, rank)
    if save_dir:
        torch.save({"model": net.module.state_dict(), "optimizer": opt.state_dict(), "ab": state.state_dict()},
                   f"{save_dir}/rank{rank}.pt")
    return weights(net.module), state.phase, state.syncs


def test_checkpoint_mid_ab_phase_resumes_exactly(tmp_path):
    full = run_ranks(_resumable, 2, total=20)
    first = run_ranks(_resumable, 2, total=20, stop_at=9, save_dir=str(tmp_path))
    assert first[0][1] == "ab", "the checkpoint must be taken inside an AB phase"
    resumed = run_ranks(_resumable, 2, total=20, resume_dir=str(tmp_path))
    for rank in range(2):
        assert resumed[rank][2] == full[rank][2]
        for n, w in full[rank][0].items():
            assert torch.equal(w, resumed[rank][0][n]), (rank, n)


def _accumulation(rank, world, micro):
    """no_sync accumulation over `micro` micro-batches vs one big batch: same phases, same weights."""
    out = []
    for accumulate in (False, True):
        net = DDP(mlp())
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        state = commhooks.ABState(opt, model=net, **SCHEDULE, mode="only-b")
        net.register_comm_hook(state, commhooks.ab_hook)
        for step in range(10):
            x, y = batch(step, rank)
            opt.zero_grad()
            if accumulate:
                chunks = list(zip(x.chunk(micro), y.chunk(micro)))
                for i, (xc, yc) in enumerate(chunks):
                    if i < micro - 1:
                        with net.no_sync():
                            (F.cross_entropy(net(xc), yc) / micro).backward()
                    else:
                        (F.cross_entropy(net(xc), yc) / micro).backward()
            else:
                F.cross_entropy(net(x), y).backward()
            opt.step()
        out.append((weights(net.module), state.step, state.syncs))
    return out


def test_no_sync_accumulation_follows_optimizer_steps():
    for (w_big, steps_big, syncs_big), (w_acc, steps_acc, syncs_acc) in run_ranks(_accumulation, 2, micro=2):
        assert steps_big == steps_acc == 10 and syncs_big == syncs_acc == 1
        for n in w_big:
            assert torch.allclose(w_big[n], w_acc[n], atol=1e-5), n


def _rebound(rank, world, total):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = commhooks.ABState(opt, model=model, **SCHEDULE, mode="only-b", rebound_steps=3)
    sched = commhooks.LRRebound(torch.optim.lr_scheduler.CosineAnnealingLR(opt, total), state)
    lrs = []
    for step in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        model.zero_grad()
        F.cross_entropy(model(batch(step, rank)[0]), batch(step, rank)[1]).backward()
        opt.step()
        sched.step()
    return lrs


def test_lr_rebound_drops_and_ramps_back_at_each_switch():
    total = 16
    lrs = run_ranks(_rebound, 1, total=total)[0]
    cosine = [0.1 * 0.5 * (1 + math.cos(math.pi * t / total)) for t in range(total)]
    switches = [4, 6, 8, 12, 14]  # enter, sync, re-basis, sync, re-basis
    for t in range(total):
        since = min((t - s for s in switches if s <= t), default=None)
        if since is None or since >= 3:
            assert lrs[t] == pytest.approx(cosine[t]), t
        else:
            assert lrs[t] == pytest.approx(1e-5 + (cosine[t] - 1e-5) * since / 3), t


def _ab_report(rank, world, group_size):
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    state = commhooks.ddp.register(net, opt, {"type": "ab", "warmup_steps": 2, "sync_period": 6,
                                              "full_rank_steps": 1, "rank_cutoff": 0.4, "min_compression_rate": 0.0,
                                              "group_size": group_size})
    for step in range(10):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return state.report(), state.format_report()


def test_the_ab_report_gives_a_traffic_ratio_only_beside_what_the_ab_steps_saved():
    """Groups of one rank: an AB step sends nothing, so the factors' parameter compression saves no traffic and the
    report says so; groups of two: the AB steps' bytes against plain allreduce's in the same steps."""
    report, text = run_ranks(_ab_report, 2, group_size=1)[0]
    assert report["ab_steps"] == 7 and report["ab_step_bytes"] == 0 and report["ab_step_traffic_ratio"] is None
    assert "AB steps: 7, sent nothing (groups of one rank" in text and "not the traffic" in text, text
    report, text = run_ranks(_ab_report, 4, group_size=2)[0]
    assert report["ab_step_bytes"] > 0 and report["ab_step_allreduce_bytes"] == 7 * report["allreduce_bytes"] / 10
    ratio = report["ab_step_allreduce_bytes"] / report["ab_step_bytes"]
    assert report["ab_step_traffic_ratio"] == round(ratio, 2) and f"({ratio:.2f}:1 less)" in text, text
