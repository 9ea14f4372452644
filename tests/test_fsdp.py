"""commhooks.fsdp: QSR across the replica groups of an FSDP2 (``fully_shard``) model, on 4 gloo ranks as 2
replica groups x 2 shards.

One spawn of 4 ranks runs every case (a DDP reference, then the FSDP run, per case) and returns what the
tests assert, so the suite starts the process group once.  The reference is the hierarchical QSR run under
DDP: each rank of a pair syncs its half of the parameters across the pairs, as an FSDP rank syncs its shard.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import commhooks
from commhooks.algorithms.contract import STEP_PROOF_BYTES
from commhooks.config import ConfigError
from tests.declared import declared
from tests.dist import run_ranks

pytestmark = pytest.mark.xdist_group("test_fsdp")  # its module fixtures are built once, on one worker

STEPS = 9


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def matrix() -> nn.Module:
    """One weight matrix: FSDP2's row shards are then the hierarchical sync's halves, element for element, so
    even a blockwise-quantized payload sees the same numbers in both runs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16, bias=False))


def batch(step: int, rank: int, features: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, features, generator=g), torch.randint(0, 4, (16,), generator=g)


CASES = {  # name: (model, config beyond QSR's)
    "plain": (mlp, {}),
    "outer-int8": (matrix, {"outer_lr": 0.7, "outer_momentum": 0.9, "payload": "int8", "error_feedback": True}),
    "overlap": (mlp, {"outer_lr": 0.7, "outer_momentum": 0.9, "overlap_steps": 1}),
    "overlap-fragments": (matrix, {"outer_lr": 0.7, "outer_momentum": 0.9, "overlap_steps": 1, "fragments": 2}),
}  # fragments and payload blocks are runs of a rank's elements: the same elements in both runs on one matrix


def _conf(extra):
    return {"type": "qsr", "h_base": 3, "alpha": 0.0, "group_size": 2, **extra}


def _train(net, opt, state, rank, start=0, stop=STEPS, save=None):
    """Steps ``start`` .. ``stop - 1`` (the run's end is the caller's), saving after step ``save[0]`` to
    ``save[1]`` if given; returns each step's bytes by tag."""
    features, by_tag = getattr(net, "module", net)[0].in_features, []
    for step in range(start, stop):
        before = dict(state.meter.by_tag())
        x, y = batch(step, rank, features)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        by_tag.append({k: v - before.get(k, 0) for k, v in state.meter.by_tag().items() if v - before.get(k, 0)})
        if save is not None and step + 1 == save[0]:
            commhooks.fsdp.save_checkpoint(save[1], net, opt, state)
    return by_tag


def _ddp(make, extra, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(make(), broadcast_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = commhooks.ddp.register(net, opt, {**_conf(extra), "hierarchical": True})
    by_tag = _train(net, opt, state, rank)
    state.finish()
    return torch.cat([p.detach().reshape(-1) for p in net.module.parameters()]), by_tag


def _sharded(make, extra, group_size=2):
    """The user's lines: a (replicate, shard) mesh, fully_shard on the blocks and the root, one register."""
    from torch.distributed.fsdp import fully_shard

    mesh = commhooks.fsdp.replica_mesh(group_size, "cpu")
    model = make()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = commhooks.fsdp.register(model, opt, {k: v for k, v in _conf(extra).items() if k != "group_size"})
    return model, opt, state


def _full(model):
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _fsdp(make, extra, rank):
    model, opt, state = _sharded(make, extra)
    by_tag = _train(model, opt, state, rank)
    state.finish()
    return _full(model), by_tag, state.report(), state.memory()


def _resume(case, stop_at, folder, rank):
    """An uninterrupted run beside one saved after step ``stop_at`` and resumed by a fresh model and state."""
    make, extra = CASES[case]
    model, opt, state = _sharded(make, extra)
    _train(model, opt, state, rank, save=(stop_at, folder))
    state.finish()
    whole = _full(model)
    model, opt, state = _sharded(make, extra)
    loaded = commhooks.fsdp.load_checkpoint(folder, model, opt, state)
    _train(model, opt, state, rank, stop_at)
    state.finish()
    return whole, _full(model), loaded["step"]


def _refusals(tmp):
    """What each refused set-up says (the message on this rank; every rank gets one, the test checks all)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    said = {}

    def say(name, fn):
        try:
            fn()
        except (ConfigError, commhooks.CheckpointError) as exc:
            said[name] = f"{type(exc).__name__}: {exc}"

    def sharded(mesh_of=lambda mesh: mesh["shard"]):
        model = mlp()
        fully_shard(model, mesh=mesh_of(commhooks.fsdp.replica_mesh(2, "cpu")))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    say("ab", lambda: commhooks.fsdp.register(*sharded(), {"type": "ab"}))
    say("group_size", lambda: commhooks.fsdp.register(*sharded(), {"type": "qsr", "group_size": 4}))
    say("hsdp", lambda: commhooks.fsdp.register(*sharded(lambda mesh: mesh), {"type": "qsr"}))
    say("none", lambda: commhooks.fsdp.register(*sharded(), {"type": "none"}))
    plain = mlp()
    say("not fully_shard", lambda: commhooks.fsdp.register(plain, torch.optim.SGD(plain.parameters(), lr=0.1),
                                                           {"type": "qsr"}))
    model, opt = sharded()
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{tmp}/bare")  # a plain FSDP2 checkpoint
    state = commhooks.fsdp.register(model, opt, {"type": "qsr"})
    say("no commhooks state", lambda: commhooks.fsdp.load_checkpoint(f"{tmp}/bare", model, opt, state))
    return said


def _worker(rank, world, tmp):
    out = {}
    for name, (make, extra) in CASES.items():
        out[name] = {"ddp": _ddp(make, extra, rank), "fsdp": _fsdp(make, extra, rank)}
    out["resume"] = {(case, at): _resume(case, at, f"{tmp}/{case}-{at}", rank) for case, at in RESUMES}
    # for the 2-rank run: a synced checkpoint (after step 6) and one mid-round (after step 7)
    make, extra = CASES["outer-int8"]
    model, opt, state = _sharded(make, extra)
    _train(model, opt, state, rank, 0, 6, save=(6, f"{tmp}/synced"))
    out["synced"] = _full(model)
    _train(model, opt, state, rank, 6, 7, save=(7, f"{tmp}/mid-round"))
    out["refused"] = _refusals(tmp)
    out["moved"] = _moved(rank)
    out["nan"] = _nan(rank)
    out["nan_last"] = _nan(rank, at=2)
    return out


def _nan(rank, at=1):
    """A NaN in rank 3's local gradient shard at loop step ``at``: every rank raises at the sync after step 3,
    naming the step and the parameter (the guard reads each DTensor gradient's local part)."""
    model, opt, state = _sharded(*CASES["plain"])
    try:
        for step in range(STEPS):
            x, y = batch(step, rank, 8)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if step == at and rank == 3:
                model[4].weight.grad.to_local().view(-1)[0] = float("nan")
            opt.step()
    except commhooks.NonFiniteError as exc:
        return state.step, str(exc)
    return state.step, None


def _moved(rank):
    """The plain case with the model re-materialized after register (``to_empty``: each DTensor gets new local
    storage, the optimizer keeps the parameter), its values put back: the syncs must follow the new storage."""
    model, opt, state = _sharded(*CASES["plain"])
    values = [p.to_local().clone() for p in model.parameters()]
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p, v in zip(model.parameters(), values):
            p.to_local().copy_(v)
    _train(model, opt, state, rank)
    state.finish()
    return _full(model)


def _one_replica(rank, world, tmp):
    """2 ranks, one replica group of 2 shards, load the 4-rank run's checkpoints."""
    make, extra = CASES["outer-int8"]
    with warnings.catch_warnings(record=True) as caught:  # one replica group: said, on every rank
        warnings.simplefilter("always")
        model, opt, state = _sharded(make, extra)
    assert any("one replica group" in str(w.message) and "replica_mesh(group_size=K)" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    loaded = commhooks.fsdp.load_checkpoint(f"{tmp}/synced", model, opt, state)
    weights = _full(model)
    _train(model, opt, state, rank, 6)
    try:
        commhooks.fsdp.load_checkpoint(f"{tmp}/mid-round", model, opt, state)
        refused = None
    except commhooks.CheckpointError as exc:
        refused = str(exc)
    return loaded["step"], weights, refused


RESUMES = [("outer-int8", 4), ("overlap-fragments", 3), ("overlap-fragments", 5)]  # mid-round; a sync in flight


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def runs(folder):
    return run_ranks(_worker, 4, timeout=300, tmp=folder)


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_qsr_ends_with_the_hierarchical_ddp_runs_parameters(runs, case):
    for rank, r in enumerate(runs):
        ddp, fsdp = r[case]["ddp"][0], r[case]["fsdp"][0]
        assert torch.allclose(ddp, fsdp, atol=1e-6, rtol=0), (rank, (ddp - fsdp).abs().max())
    assert all(torch.equal(runs[0][case]["fsdp"][0], r[case]["fsdp"][0]) for r in runs), "replicas end identical"


def _payload(traffic) -> int:
    """Bytes of the syncs' payloads (every fragment's), without the step proof each call carries."""
    return sum(s.nbytes - STEP_PROOF_BYTES for s in traffic.sends() if s.tag.startswith("sync"))


@pytest.mark.parametrize("case", list(CASES))
def test_cross_group_bytes_are_the_declarations_and_a_shard_of_the_ddp_runs(runs, case):
    make, extra = CASES[case]
    conf = _conf(extra)
    for rank, r in enumerate(runs):
        by_tag = r[case]["fsdp"][1]
        fsdp = declared(conf, make(), world=4, steps=STEPS, rank=rank, engine_data_parallel=True, shard_rows=True)
        assert by_tag == [fsdp.at(step + 1) for step in range(STEPS)], (rank, by_tag)
        assert fsdp.step == () and fsdp.before == (), "nothing crosses the groups on a step that does not sync"
        assert {s.scope for s in fsdp.sends()} == {"across"}, "a shard meets only its counterparts"
        # DDP: every rank sends the whole model (the allgather, as the 2 groups' exchange is)
        exchange = {"payload_exchange": "allgather"} if conf.get("payload", "fp32") != "fp32" else {}
        ddp = declared({**conf, **exchange}, make(), world=4, steps=STEPS, rank=rank)
        assert 2 * _payload(fsdp) == _payload(ddp) > 0, (_payload(fsdp), _payload(ddp))


@pytest.mark.parametrize("case,at", RESUMES)
def test_exact_resume_through_dcp_mid_round_and_mid_overlap(runs, case, at):
    for r in runs:
        whole, resumed, step = r["resume"][(case, at)]
        assert step == at
        assert torch.equal(whole, resumed), (case, at, (whole - resumed).abs().max())


def test_a_synced_checkpoint_loads_at_another_replica_count_and_a_mid_round_one_is_refused(runs, folder):
    one = run_ranks(_one_replica, 2, timeout=120, tmp=folder)
    for rank, (step, weights, refused) in enumerate(one):
        assert step == 6 and torch.equal(weights, runs[0]["synced"]), "the 2x2 run's weights after its sync"
        assert refused is not None and "saved by 4 ranks in shard groups of 2 at step 7" in refused, refused
        assert "synced_only=True" in refused


REFUSED = {  # what each refusal must name
    "ab": ["'ab'", "engine_data_parallel", "'qsr'"],
    "group_size": ["qsr.group_size 4", "shard group's 2"],
    "hsdp": ["2-D mesh", "mesh['shard']", "replica_mesh"],
    "none": ["{'type': 'none'}", "HSDP"],
    "not fully_shard": ["fully_shard", "Sequential"],
    "no commhooks state": ["holds no commhooks state", "bare"],
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cannot_work_is_refused_on_every_rank_naming_why(runs, name):
    for r in runs:
        said = r["refused"].get(name)
        assert said is not None, f"{name}: no error"
        for part in REFUSED[name]:
            assert part in said, (name, part, said)


def test_syncs_follow_a_parameter_moved_to_new_storage(runs):
    for r in runs:
        assert torch.equal(r["moved"], r["plain"]["fsdp"][0])


def test_a_nan_in_one_shard_is_named_on_every_rank_at_the_next_sync(runs):
    # rank 3's NaN (loop step 1: its 2nd optimizer step) reaches rank 2, its shard peer, through the next forward's
    # all-gather (loop step 2); the sync spans one rank per replica group ({0, 2} and {1, 3}), yet every rank
    # counts both ranks, over the world
    for rank, r in enumerate(runs):
        step, said = r["nan"]
        assert step == 3 and said is not None, (rank, r["nan"])
        assert said.startswith("NaN or Inf gradient on 2 of 4 ranks since the last sync, found at the QSR sync "
                               "after optimizer step 3: "), (rank, said)
        assert {3: "at optimizer step 2 on rank 3 in: 4.weight", 2: "at optimizer step 3 on rank 2 in: 0.weight",
                1: "none on this rank (1)", 0: "none on this rank (0)"}[rank] in said, (rank, said)
        # a NaN at the sync's own step reaches no peer: the sync of ranks 0 and 2 saw none, and they raise too
        # (before: they went on to their shard group's collective, which ranks 1 and 3 had left, and failed there)
        step, said = r["nan_last"]
        assert step == 3 and said is not None and said.startswith(
            "NaN or Inf gradient on 1 of 4 ranks since the last sync, found at the QSR sync after optimizer step 3: "
            + ("at optimizer step 3 on rank 3 in: 4.weight" if rank == 3 else f"none on this rank ({rank})")), said
