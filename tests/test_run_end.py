"""Every run ends the way the user asked: with the same model on every rank.

* ``total_steps`` is honoured by every local algorithm (AB's fixed rule too): a run whose length is not a
  multiple of the period ends with a sync;
* without it, ``with state:`` (or ``state.finish()``) ends the run synced, and a run with none of them that really
  ends between two syncs warns, once, when it ends (the state dropped, or the process exiting), on every rank;
* a trainable parameter that no given optimizer steps is named on every rank ("pass every optimizer").
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from tests.dist import run_ranks

AB = {"type": "ab", "warmup_steps": 2, "sync_period": 4, "full_rank_steps": 1, "group_size": 1,
      "min_compression_rate": 1.01, "rank_cutoff": 0.8}
QSR = {"type": "qsr", "h_base": 4}


def _tokens(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randint(0, 10, (8, 5), generator=g, device="cpu"),
            torch.randint(0, 3, (8,), generator=g, device="cpu"))


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 12)
        self.body = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))

    def forward(self, ids):
        return self.body(self.emb(ids).mean(1))


def _run(conf, steps, rank, use_with=False, two_optimizers=False, give_both=True):
    net = DDP(Body(), forward_sync_buffers=False)
    body = torch.optim.SGD(net.module.body.parameters(), lr=0.1, momentum=0.9)
    optimizers = [body]
    if two_optimizers:
        optimizers.append(torch.optim.SGD(net.module.emb.parameters(), lr=0.5))
    else:
        body.add_param_group({"params": list(net.module.emb.parameters())})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = commhooks.ddp.register(net, optimizers if give_both else optimizers[:1], conf)
        context = state if use_with else torch.enable_grad()
        with context:
            for step in range(steps):
                ids, y = _tokens(step, rank)
                for opt in optimizers:
                    opt.zero_grad()
                F.cross_entropy(net(ids), y).backward()
                for opt in optimizers:
                    opt.step()
        state.end_check()  # what dropping the state or the process's exit runs: the end-of-run check
    checksum = float(sum(p.detach().double().sum() for p in net.module.parameters()))
    return {"checksum": checksum, "syncs": state.syncs, "step": state.step,
            "warnings": [str(w.message) for w in caught if "commhooks" in w.filename or "QSR" in str(w.message)
                         or "AB" in str(w.message)]}


def _resumed_never_stepped(conf, rank):
    """A state loaded from an open round (between syncs) and dropped before a step of its own: nothing to warn
    about in this process (its run went on elsewhere); the same state that steps once more does warn."""
    net = DDP(Body(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = commhooks.ddp.register(net, opt, conf)
        for step in range(6):  # 6 of a period of 4: an open round
            ids, y = _tokens(step, rank)
            opt.zero_grad()
            F.cross_entropy(net(ids), y).backward()
            opt.step()
        saved = state.state_dict()
        state.end_check.detach()  # (this first run's own check is not what the test asks about)
        for name, steps in (("loaded", 0), ("loaded-then-stepped", 1)):
            net2 = DDP(Body(), forward_sync_buffers=False)
            opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
            resumed = commhooks.ddp.register(net2, opt2, conf)
            resumed.load_state_dict(saved)
            for step in range(steps):
                ids, y = _tokens(10 + step, rank)
                opt2.zero_grad()
                F.cross_entropy(net2(ids), y).backward()
                opt2.step()
            before = len(caught)
            resumed.end_check()
            out[name] = [str(w.message) for w in caught[before:] if "between two syncs" in str(w.message)]
    return out


def _scenarios(rank, world):
    return {
        "qsr-resumed": _resumed_never_stepped(QSR, rank),
        "ab-fixed-total": _run({**AB, "total_steps": 11}, 11, rank),  # 11 is no multiple of 4
        "qsr-constant-total": _run({**QSR, "total_steps": 10}, 10, rank),
        "ab-with": _run(AB, 11, rank, use_with=True),
        "qsr-with": _run(QSR, 10, rank, use_with=True),
        "qsr-open": _run(QSR, 10, rank),  # neither: warned, and really apart
        "ab-open": _run(AB, 11, rank),
        "two-optimizers-one-given": _run({**QSR, "total_steps": 10}, 10, rank, two_optimizers=True, give_both=False),
        "two-optimizers-both-given": _run({**QSR, "total_steps": 10}, 10, rank, two_optimizers=True),
    }


def test_runs_end_synced_or_say_why_not():
    r0, r1 = run_ranks(_scenarios, 2, timeout=240)
    for name in ("ab-fixed-total", "qsr-constant-total", "ab-with", "qsr-with", "two-optimizers-both-given"):
        assert r0[name]["checksum"] == r1[name]["checksum"], (name, r0[name], r1[name])
        assert r0[name]["warnings"] == r1[name]["warnings"] == [], (name, r0[name]["warnings"])
    for name in ("qsr-open", "ab-open"):  # the run ends between syncs: the ranks differ, and were told
        assert r0[name]["checksum"] != r1[name]["checksum"], name
        for r in (r0, r1):
            found = [w for w in r[name]["warnings"] if "between two syncs" in w]
            assert len(found) == 1 and "`with state:`" in found[0] and "state.finish()" in found[0], r[name]
            assert "the run ended at step" in found[0], found
    assert r0["ab-fixed-total"]["syncs"] == 3  # at 4, 8 and the run's end, 11
    for r in (r0, r1):  # a state resumed and dropped before it stepped says nothing; one that stepped does
        assert r["qsr-resumed"]["loaded"] == [] and len(r["qsr-resumed"]["loaded-then-stepped"]) == 1, r["qsr-resumed"]
    for r in (r0, r1):  # the embedding stepped by an optimizer the state was not given: named on every rank
        found = [w for w in r["two-optimizers-one-given"]["warnings"] if "in none of the optimizers given" in w]
        assert len(found) == 1 and "emb.weight" in found[0] and "pass every optimizer" in found[0], found
    assert r0["two-optimizers-one-given"]["checksum"] != r1["two-optimizers-one-given"]["checksum"]


@pytest.mark.parametrize("first_run", [0, 5])
def test_plain_scripts_exit_cleanly_without_shutdown(first_run):
    """10 two-rank runs of a script (AB: 6 of 15 such runs aborted before) that never tears down the process
    group: every rank of every run exits 0.  The ranks are started directly, as a launcher would.  Five runs a
    test, so that the two halves run side by side."""
    failed = []
    for i in range(first_run, first_run + 5):
        for r, (code, out) in enumerate(_launch_plain({"ALGO": "ab"})):
            if code != 0 or "done" not in out:
                failed.append((i, r, code, out[-500:]))
    assert not failed, failed


def _launch_plain(env, timeout=120):
    """Two ranks of tests/scripts/plain_exit.py, started as a launcher would; [(returncode, output)] by rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from commhooks.launch import free_port

    repo = Path(__file__).resolve().parents[1]
    port = str(free_port("127.0.0.1"))
    procs = [subprocess.Popen([sys.executable, str(repo / "tests" / "scripts" / "plain_exit.py")], cwd=repo,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": "2",
                                   "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": port, **env})
             for r in range(2)]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def test_the_end_of_run_warning_fires_only_when_a_run_really_ends_apart():
    """A script that calls state.finish() after its loop prints no end-of-run warning (it used to print one at
    the first step, whatever followed); the same script without it, ending between syncs, warns at exit on every
    rank.  QSR with an outer step, int8 and overlap (streamed rounds: only a blocking sync ends one)."""
    for end, warned in (("finish", False), ("open", True)):
        for rank, (code, out) in enumerate(_launch_plain({"ALGO": "qsr", "END": end})):
            assert code == 0 and "done" in out, (end, rank, out[-2000:])
            assert ("the run ended at step 12, between two syncs" in out) == warned, (end, rank, out[-2000:])
            assert "total_steps is not set" not in out, out


def _unfrozen(rank, world, unfreeze_at, adam):
    """A layer frozen when DDP built its buckets and unfrozen later (fine-tuning): DDP never reduces its
    gradient, so the state does, in AB's warm-up and full-rank steps (world mean) and its AB steps (group)."""
    net = Body()
    for p in net.emb.parameters():
        p.requires_grad_(False)
    net = DDP(net, forward_sync_buffers=False)
    opt = (torch.optim.AdamW(net.module.parameters(), lr=0.01) if adam else
           torch.optim.SGD(net.module.parameters(), lr=0.1, momentum=0.9))
    state = commhooks.ddp.register(net, opt, {**AB, "warmup_steps": 6, "sync_period": 5, "full_rank_steps": 2,
                                             "total_steps": 20})
    apart = []
    for step in range(20):
        if step == unfreeze_at:
            for p in net.module.emb.parameters():
                p.requires_grad_(True)
        ids, y = _tokens(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(ids), y).backward()
        opt.step()
        emb = net.module.emb.weight.detach().clone()
        torch.distributed.all_reduce(emb, op=torch.distributed.ReduceOp.MAX)
        apart.append((state.phase, float((emb - net.module.emb.weight.detach()).abs().max())))
    return apart


@pytest.mark.parametrize("unfreeze_at, adam", [(2, False), (8, True), (10, True)])
def test_a_layer_unfrozen_after_ddp_is_averaged_where_the_algorithm_averages(unfreeze_at, adam):
    """Unfrozen in warm-up, in an AB phase, in a full-rank phase: identical on every rank in every warm-up and
    full-rank step (they average every trainable parameter), and at the end."""
    for apart in run_ranks(_unfrozen, 2, timeout=120, unfreeze_at=unfreeze_at, adam=adam):
        together = [d for phase, d in apart if phase != "ab"]
        assert len(together) >= 10 and together == [0.0] * len(together), apart
        assert any(d > 0 for phase, d in apart if phase == "ab"), apart  # groups of one drift: the check can fail
        assert apart[-1][1] == 0.0, apart  # and synced at the end


def _ddp_join_idiom(rank, world):
    """PyTorch's documented idiom for uneven inputs, `with ddp_model.join():` (not `Join([ddp_model, state])`):
    the state takes part too, so the rank out of data shadows the syncs and the ranks end identical.  On both
    routes: ``commhooks.ddp.register``, and the two lines ``QSRState(opt, model=ddp_model)`` +
    ``ddp_model.register_comm_hook(state, commhooks.comm_hook)`` (before, a gloo rank aborted there: "Received
    data size doesn't match expected size"), for QSR and AB."""
    out = {}
    for route in ("register", "two-line"):
        for name, conf in (("qsr", {**QSR, "h_base": 3}), ("ab", {**AB, "warmup_steps": 3})):
            net = DDP(Body(), forward_sync_buffers=False)
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            if route == "register":
                state = commhooks.ddp.register(net, opt, conf)
            else:
                cls = commhooks.QSRState if conf["type"] == "qsr" else commhooks.ABState
                state = cls(opt, model=net, **{k: v for k, v in conf.items() if k != "type"})
                net.register_comm_hook(state, commhooks.comm_hook)
            batches = 10 if rank == 0 else 7
            with net.join():
                for step in range(batches):
                    ids, y = _tokens(step, rank)
                    opt.zero_grad()
                    F.cross_entropy(net(ids), y).backward()
                    opt.step()
            out[route, name] = (float(sum(p.detach().double().sum() for p in net.module.parameters())), state.step)
    return out


def test_ddp_join_idiom_includes_the_state_on_both_routes():
    r0, r1 = run_ranks(_ddp_join_idiom, 2, timeout=180)
    assert set(r0) == {(route, name) for route in ("register", "two-line") for name in ("qsr", "ab")}, r0
    for key in r0:
        (c0, s0), (c1, s1) = r0[key], r1[key]
        assert c0 == c1 and s0 == s1 == 10, (key, c0, c1, s0, s1)


# --------------------------------------------------------------------------
# Join contexts, per epoch and at an uneven end; layers DDP never saw; sparse gradients
# --------------------------------------------------------------------------


class Spare(Body):
    """Body with a layer the forward never uses (``spare``): trainable, but no rank ever has its gradient."""

    def __init__(self):
        super().__init__()
        self.spare = nn.Linear(3, 3)


def _loop(net, opts, state, batches, rank, epochs=1, join_each_epoch=False, unfreeze_at=None, offset=0):
    step = 0
    for _ in range(epochs):
        context = net.join() if join_each_epoch else torch.enable_grad()
        with context:
            for _ in range(batches):
                if step == unfreeze_at:
                    for p in list(net.module.emb.parameters()) + list(net.module.spare.parameters()):
                        p.requires_grad_(True)
                ids, y = _tokens(step + offset, rank)
                for opt in opts:
                    opt.zero_grad()
                F.cross_entropy(net(ids), y).backward()
                for opt in opts:
                    opt.step()
                step += 1


def _epochs(rank, conf, join_each_epoch):
    """3 epochs of 5 even steps, inside `with state:`; `with ddp_model.join():` around each epoch or not."""
    net = DDP(Body(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = commhooks.ddp.register(net, opt, conf)
    with state:
        _loop(net, [opt], state, 5, rank, epochs=3, join_each_epoch=join_each_epoch)
    return float(sum(p.detach().double().sum() for p in net.module.parameters())), state.syncs


def _join_scenarios(rank, world):
    out = {}
    for name, conf in (("qsr", QSR), ("ab-warmup", {**AB, "warmup_steps": 40})):
        out[name] = {"plain": _epochs(rank, conf, False), "join-per-epoch": _epochs(rank, conf, True)}
    # uneven inputs under Join while a layer unfrozen after DDP was built (a stray) is reduced by the state:
    # the joined rank sends zeros for it, so the collectives pair up; `spare` has no gradient on any rank
    model = Spare()
    for p in list(model.emb.parameters()) + list(model.spare.parameters()):
        p.requires_grad_(False)
    net = DDP(model, forward_sync_buffers=False)
    opt = torch.optim.SGD(net.module.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    state = commhooks.ddp.register(net, opt, {**AB, "warmup_steps": 40, "total_steps": 8, "timeout_s": 30})
    spare0 = net.module.spare.weight.detach().clone()
    with net.join():
        _loop(net, [opt], state, 8 if rank == 0 else 6, rank, unfreeze_at=2)
    out["uneven-strays"] = {"checksum": float(sum(p.detach().double().sum() for p in net.module.parameters())),
                            "step": state.step, "spare_unchanged": torch.equal(spare0, net.module.spare.weight),
                            "spare_grad": net.module.spare.weight.grad is None}
    # sparse gradients: QSR (local steps, nothing reduced) takes them; AB, which averages gradients, names the layer
    for name, conf in (("qsr-sparse", {**QSR, "total_steps": 6}), ("ab-sparse", AB)):
        body = Body()
        body.emb = nn.Embedding(10, 12, sparse=True)
        net = DDP(body, forward_sync_buffers=False)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        state = commhooks.ddp.register(net, opt, conf)
        try:
            for step in range(6):
                ids, y = _tokens(step, rank)
                opt.zero_grad()
                F.cross_entropy(net(ids), y).backward()
                opt.step()
            out[name] = float(sum(p.detach().double().sum() for p in net.module.parameters()))
        except commhooks.ConfigError as exc:
            out[name] = str(exc)
    return out


def test_join_contexts_strays_and_sparse_gradients():
    r0, r1 = run_ranks(_join_scenarios, 2, timeout=240)
    for name in ("qsr", "ab-warmup"):  # a per-epoch join on even shards leaves the schedule (and AB's optimizer) be
        assert r0[name]["plain"] == r0[name]["join-per-epoch"] == r1[name]["join-per-epoch"], (name, r0[name], r1[name])
    assert r0["qsr"]["plain"][1] == 4, r0["qsr"]  # syncs at 4, 8, 12 and the end (15), none at the epochs' ends
    for r in (r0, r1):
        u = r["uneven-strays"]
        assert u["step"] == 8 and u["spare_unchanged"] and u["spare_grad"], u
    assert r0["uneven-strays"]["checksum"] == r1["uneven-strays"]["checksum"]
    assert isinstance(r0["qsr-sparse"], float) and r0["qsr-sparse"] == r1["qsr-sparse"]
    for r in (r0, r1):
        assert "emb.weight" in r["ab-sparse"] and "sparse=False" in r["ab-sparse"], r["ab-sparse"]
