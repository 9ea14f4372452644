"""Ranks that step differently: GradScaler skips, uneven inputs with Join, a forced mismatch,
several optimizers, parameters that appear later. Real gloo ranks, hard timeouts."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.config import ConfigError
from tests.dist import run_ranks

STEPS = 12
QSR = {"type": "qsr", "h_base": 3, "total_steps": STEPS, "check_every": 1}
AB = {"type": "ab", "warmup_steps": 2, "sync_period": 6, "full_rank_steps": 1, "rank_cutoff": 0.4,
      "min_compression_rate": 0.0, "group_size": 1, "check_every": 1}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(step, rank):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def flat(net):
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()


# --------------------------------------------------------------------------
# GradScaler: a skipped step counts, the schedule stays common
# --------------------------------------------------------------------------


def _scaler(rank, world, hook, overflow_at, give_scaler=True):
    import warnings

    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))  # a decaying lr: QSR alpha > 0 matters
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    state = commhooks.ddp.register(net, opt, hook, scaler=scaler if give_scaler else None)
    scales = []
    warnings.simplefilter("always")
    caught = warnings.catch_warnings(record=True)
    log = caught.__enter__()
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        if rank == 1 and step in overflow_at:
            loss = loss * float("inf")  # this rank's gradients overflow; the other rank's do not
        scaler.scale(loss).backward()  # the standard recipe, not one line added
        scaler.step(opt)
        scaler.update()
        sched.step()
        scales.append(scaler.get_scale())
    caught.__exit__(None, None, None)
    if not give_scaler:
        return [str(w.message) for w in log]
    return state.step, state.sync_steps, state.skipped_steps, flat(net), scales


@pytest.mark.parametrize("hook", [QSR, {**QSR, "alpha": 0.2, "h_base": 2}, AB],
                         ids=["qsr-alpha0", "qsr-alpha>0", "ab-groups"])
def test_grad_scaler_overflow_on_one_rank_keeps_the_schedule(hook):
    results = run_ranks(_scaler, 2, timeout=120, hook=hook, overflow_at=(4, 7))
    (s0, sync0, skip0, w0, sc0), (s1, sync1, skip1, w1, sc1) = results
    assert s0 == s1 == STEPS, (s0, s1)
    assert sync0 == sync1 and sync0[-1] == STEPS, (sync0, sync1)
    assert sc0 != sc1, "the overflow really happened on rank 1 only"
    assert sc0[-1] == sc1[-1], "the syncs gave the scalers one scale again"
    assert skip1 - skip0 == 2 if hook["type"] == "qsr" else skip1 >= skip0
    assert torch.equal(w0, w1), "parameters must be bit-identical after the final sync"


def test_scales_that_part_without_the_scaler_are_a_warning_for_ab():
    for caught in run_ranks(_scaler, 2, timeout=120, hook=AB, overflow_at=(4,), give_scaler=False):
        assert any("at the sync after optimizer step 6 the ranks' GradScaler scales differ" in m and "use_scaler" in m
                   for m in caught), caught


def _ab_full_rank_steps(rank, world, overflow_at, unfreeze_at):
    """AB, groups of one rank, 20 steps: the parameters (and GradScaler scales) of every rank after each full-rank
    step, with rank 1's gradients overflowing at ``overflow_at`` and the first layer, frozen when DDP was built,
    unfrozen at ``unfreeze_at``."""
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    net = DDP(model, forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    state = commhooks.ddp.register(net, opt, {**AB, "sync_period": 5, "full_rank_steps": 2}, scaler=scaler)
    after_full = []
    for step in range(20):
        if step == unfreeze_at:
            for p in model[0].parameters():
                p.requires_grad_(True)
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y) * (float("inf") if rank == 1 and step in overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if state.phase == "full" or state.step % 5 in (1, 2):  # the full-rank steps after each sync
            after_full.append((state.step, flat(net), scaler.get_scale()))
    return after_full


def test_ab_full_rank_steps_end_identical_after_an_overflow_in_the_sync_step_and_a_layer_unfrozen():
    """An overflow on one rank in the sync step itself (its scaler backs off only after the sync, just before the
    full-rank steps), another in a local step, and a layer unfrozen mid-run (never in DDP's buckets): every
    full-rank step ends with the same parameters and scale on both ranks."""
    r0, r1 = run_ranks(_ab_full_rank_steps, 2, timeout=120, overflow_at=(5, 8), unfreeze_at=6)
    assert [s for s, _, _ in r0] == [s for s, _, _ in r1] and len(r0) >= 4, r0
    for (step, w0, sc0), (_, w1, sc1) in zip(r0, r1):
        assert sc0 == sc1, (step, sc0, sc1)
        assert torch.equal(w0, w1), (step, (w0 - w1).abs().max())


def _scaler_matches_manual_skip(rank, world):
    """With no overflow, the scaler path gives the same parameters as the plain loop (unscale is exact)."""
    out = []
    for use_scaler in (False, True):
        net = DDP(mlp(), forward_sync_buffers=False)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        commhooks.ddp.register(net, opt, QSR)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
        for step in range(STEPS):
            x, y = batch(step, rank)
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            if use_scaler:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        out.append(flat(net))
    return out


def test_grad_scaler_without_overflow_equals_the_plain_loop():
    for plain, scaled in run_ranks(_scaler_matches_manual_skip, 2, timeout=120):
        assert torch.equal(plain, scaled)


# --------------------------------------------------------------------------
# a step mismatch is an error on every rank, naming both steps
# --------------------------------------------------------------------------


def _extra_step(rank, world):
    """Rank 0 steps its optimizer once more at iteration 1: with a decaying lr and alpha > 0 its next
    round gets another period, so the two ranks reach a sync at different step counts."""
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = commhooks.ddp.register(net, opt, {**QSR, "h_base": 2, "alpha": 0.06, "timeout_s": 60})
    try:
        for step in range(STEPS):
            x, y = batch(step, rank)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
            if rank == 0 and step == 1:
                opt.step()  # one optimizer step too many on rank 0
            sched.step()
    except commhooks.DivergenceError as exc:
        return str(exc), state.step
    return None, state.step


def test_step_mismatch_raises_divergence_error_on_every_rank():
    (m0, s0), (m1, s1) = run_ranks(_extra_step, 2, timeout=120)
    assert m0 is not None and m1 is not None, (m0, m1)
    assert s0 != s1
    for m, mine, other in ((m0, s0, s1), (m1, s1, s0)):
        assert f"at step {mine}, the other rank is at step {other}" in m, m
        assert "GradScaler" in m and "Join" in m, m  # the likely causes


# --------------------------------------------------------------------------
# uneven inputs: Join shadows syncs and phase switches
# --------------------------------------------------------------------------


def _uneven(rank, world, hook, batches):
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = commhooks.ddp.register(net, opt, hook)
    with Join([net, state]):
        for step in range(batches[rank]):
            x, y = batch(step, rank)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    return state.step, state.syncs, flat(net)


@pytest.mark.parametrize("hook", [{**QSR, "total_steps": None, "h_base": 4},
                                  {**QSR, "total_steps": None, "h_base": 2, "alpha": 0.3},
                                  {**AB, "sync_period": 8}], ids=["qsr", "qsr-alpha>0", "ab"])
def test_uneven_inputs_with_join(hook):
    (s0, n0, w0), (s1, n1, w1) = run_ranks(_uneven, 2, timeout=150, hook=hook, batches=(40, 37))
    assert s0 == s1 == 40, (s0, s1)  # the joined rank shadowed the last 3 steps
    assert n0 == n1
    assert torch.equal(w0, w1), "every rank holds the same parameters after the Join context"


def _uneven_without_join(rank, world, batches):
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    commhooks.ddp.register(net, opt, {**QSR, "total_steps": None, "h_base": 4, "timeout_s": 15})
    try:
        for step in range(batches[rank]):
            x, y = batch(step, rank)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    except commhooks.CollectiveError as exc:
        return str(exc)
    return "finished"


def test_uneven_inputs_without_join_name_the_cause():
    done, error = run_ranks(_uneven_without_join, 2, timeout=120, batches=(37, 40))
    assert done == "finished"
    assert "Join" in error and "step" in error, error


# --------------------------------------------------------------------------
# every trainable parameter is in the sync
# --------------------------------------------------------------------------


def _two_optimizers(rank, world):
    net = DDP(mlp(), forward_sync_buffers=False)
    head = list(net.module[4].parameters())
    body = [p for p in net.parameters() if all(p is not h for h in head)]
    opt_body = torch.optim.SGD(body, lr=0.05, momentum=0.9)
    opt_head = torch.optim.Adam(head, lr=0.01)
    state = commhooks.QSRState([opt_body, opt_head], model=net, **{k: v for k, v in QSR.items() if k != "type"})
    net.register_comm_hook(state, commhooks.comm_hook)
    for step in range(STEPS):
        x, y = batch(step, rank)
        opt_body.zero_grad()
        opt_head.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt_body.step()
        opt_head.step()
    return state.step, state.syncs, flat(net)


def test_two_optimizers_count_one_step_and_sync_everything():
    (s0, n0, w0), (s1, n1, w1) = run_ranks(_two_optimizers, 2, timeout=120)
    assert s0 == s1 == STEPS and n0 == n1 == STEPS // 3
    assert torch.equal(w0, w1)


def _late_parameters(rank, world, kind):
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)  # frozen when the state is built
    net = DDP(model, forward_sync_buffers=False)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.05)
    hook = {**QSR, "h_base": 2} if kind == "qsr" else {**AB, "warmup_steps": 2, "sync_period": 4}
    state = commhooks.ddp.register(net, opt, hook)
    extra = nn.Parameter(torch.ones(5))
    for step in range(STEPS):
        if step == 3:  # unfreeze the first layer, and add a parameter that lives outside the model
            for p in model[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()) + [extra]})
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y) + (extra * (rank + 1)).sum() * (step >= 3)
        loss.backward()
        opt.step()
    names = [n for n, _ in state.named_params]
    return state.syncs, flat(net), extra.detach().clone(), names


@pytest.mark.parametrize("kind", ["qsr", "ab"])
def test_parameters_that_appear_later_join_the_sync(kind):
    (n0, w0, e0, names0), (n1, w1, e1, names1) = run_ranks(_late_parameters, 2, timeout=150, kind=kind)
    assert n0 == n1 > 0
    assert torch.equal(w0, w1) and torch.equal(e0, e1), "unfrozen and added parameters are averaged too"
    assert "module.0.weight" in names0 or "0.weight" in names0, names0
    assert names0 == names1 and any(n.startswith("optimizer.") for n in names0), names0


def _unknown_parameter_without_model(rank, world):
    p = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    try:
        commhooks.QSRState([opt, "not an optimizer"], h_base=2)
    except ConfigError as exc:
        return str(exc)


def test_bad_optimizer_list_is_a_config_error():
    for m in run_ranks(_unknown_parameter_without_model, 1, timeout=60):
        assert "optimizer" in m and "str" in m, m


# --------------------------------------------------------------------------
# checkpoints that never lie
# --------------------------------------------------------------------------


def _train(net, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


def _build(hook=QSR):
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return net, opt, commhooks.ddp.register(net, opt, {**hook, "total_steps": None})


def _save_at_different_steps(rank, world, ckdir):
    net, opt, state = _build()
    _train(net, opt, rank, 4 + rank)  # rank 1 one step further (and past a sync) than rank 0
    try:
        commhooks.save_checkpoint(ckdir, net, opt, state)
    except commhooks.DivergenceError as exc:
        return str(exc)


def test_save_at_different_steps_is_refused_on_every_rank(tmp_path):
    for m in run_ranks(_save_at_different_steps, 2, timeout=60, ckdir=str(tmp_path)):
        assert m is not None and "from 4 to 5" in m and "nothing was written" in m, m
    assert not any(tmp_path.iterdir())


def _broken_checkpoints(rank, world, ckdir, damage):
    from pathlib import Path
    import warnings

    net, opt, state = _build()
    _train(net, opt, rank, 3)
    commhooks.save_checkpoint(ckdir, net, opt, state, keep=5)
    _train(net, opt, rank, 3, start=3)
    commhooks.save_checkpoint(ckdir, net, opt, state, keep=5)
    root = Path(ckdir)
    state.comm.barrier()
    if rank == 0:
        if damage == "latest-names-missing-folder":
            (root / "latest").write_text("step-00000099")
        elif damage == "missing-rank-file":
            (root / "step-00000006" / "rank1.pt").unlink()
        elif damage == "truncated-rank-file":
            f = root / "step-00000006" / "rank1.pt"
            f.write_bytes(f.read_bytes()[:500])
    state.comm.barrier()
    fresh, fresh_opt, fresh_state = _build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ck = commhooks.load_checkpoint(ckdir, fresh, fresh_opt, fresh_state)
        except commhooks.CheckpointError as exc:
            return "error", str(exc), []
    return ck["step"], fresh_state.step, [str(w.message) for w in caught]


@pytest.mark.parametrize("damage, resumed", [("latest-names-missing-folder", 6), ("missing-rank-file", 3),
                                             ("truncated-rank-file", 3)])
def test_load_falls_back_to_the_newest_complete_checkpoint(damage, resumed, tmp_path):
    for step, state_step, warned in run_ranks(_broken_checkpoints, 2, timeout=90, ckdir=str(tmp_path), damage=damage):
        assert step == state_step == resumed, (damage, step, state_step)
        text = " ".join(warned)
        if damage == "latest-names-missing-folder":
            assert "step-00000099" in text, warned
        else:
            assert "skipped newer checkpoints: step-00000006" in text and "rank1.pt" in text, warned


def _explicit_broken_step(rank, world, ckdir):
    from pathlib import Path

    net, opt, state = _build()
    _train(net, opt, rank, 3)
    commhooks.save_checkpoint(ckdir, net, opt, state)
    state.comm.barrier()
    if rank == 0:
        f = Path(ckdir) / "step-00000003" / "rank1.pt"
        f.write_bytes(f.read_bytes()[:300])
    state.comm.barrier()
    try:
        commhooks.load_checkpoint(ckdir, *_build()[:2], step=3)
    except commhooks.CheckpointError as exc:
        return str(exc)


def test_a_broken_requested_checkpoint_is_an_error_on_every_rank_naming_the_file(tmp_path):
    for m in run_ranks(_explicit_broken_step, 2, timeout=60, ckdir=str(tmp_path)):
        assert m is not None and "step-00000003/rank1.pt" in m, m


def _save_for_resize(rank, world, ckdir, synced_only):
    net, opt, state = _build()
    _train(net, opt, rank, 6 if synced_only else 5)  # h_base 3: step 6 is a sync step, 5 is not
    return str(commhooks.save_checkpoint(ckdir, net, opt, state, synced_only=synced_only))


def _resume_on_one_rank(rank, world, ckdir):
    net, opt, state = _build({**QSR, "h_base": 3})
    try:
        ck = commhooks.load_checkpoint(ckdir, net, opt, state)
    except commhooks.CheckpointError as exc:
        return str(exc)
    return ck["step"], state.step, flat(net)


def test_another_world_size_needs_a_synced_checkpoint(tmp_path):
    run_ranks(_save_for_resize, 2, timeout=60, ckdir=str(tmp_path / "mid"), synced_only=False)
    message = run_ranks(_resume_on_one_rank, 1, timeout=60, ckdir=str(tmp_path / "mid"))[0]
    assert "written by 2 ranks and this run has 1" in message and "synced_only=True" in message, message
    saved = run_ranks(_save_for_resize, 2, timeout=60, ckdir=str(tmp_path / "synced"), synced_only=True)
    assert saved[0].endswith("step-00000006")
    step, state_step, _ = run_ranks(_resume_on_one_rank, 1, timeout=60, ckdir=str(tmp_path / "synced"))[0]
    assert step == state_step == 6


class Evil:
    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/commhooks-evil-ran",))


def _evil_checkpoint(rank, world, ckdir):
    import os

    net, opt, state = _build()
    _train(net, opt, rank, 3)
    commhooks.save_checkpoint(ckdir, net, opt, state, extra={"payload": Evil()})
    if os.path.exists("/tmp/commhooks-evil-ran"):
        os.remove("/tmp/commhooks-evil-ran")
    try:
        commhooks.load_checkpoint(ckdir, *_build()[:2], step=3)
    except commhooks.CheckpointError as exc:
        return str(exc), os.path.exists("/tmp/commhooks-evil-ran")
    return None, os.path.exists("/tmp/commhooks-evil-ran")


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    for message, ran in run_ranks(_evil_checkpoint, 2, timeout=60, ckdir=str(tmp_path)):
        assert not ran, "unpickling ran foreign code"
        assert message is not None and "rank0.pt" in message and "refused" in message, message
        assert "GLOBAL posix.system" in message and "weights_only=False" not in message, message


def _starts(rank, world):
    """States built by hand on a plain module (no DDP to broadcast the start), QSR and AB: a script that seeds no
    model gives each rank its own weights and BatchNorm statistics."""
    import warnings

    out = {}
    for name, conf in (("qsr", {"h_base": 2}), ("ab", {"warmup_steps": 2, "sync_period": 3, "full_rank_steps": 1, "group_size": 1}),
                       ("qsr-seeded", {"h_base": 2})):
        torch.manual_seed(0 if name.endswith("seeded") else 100 + rank)
        net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        net[1].running_mean.add_(0 if name.endswith("seeded") else rank)
        before = {k: v.clone() for k, v in net.state_dict().items()}
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        cls = commhooks.ABState if name == "ab" else commhooks.QSRState
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = cls(opt, model=net, **conf)
        out[name] = {"before": before, "after": {k: v.clone() for k, v in net.state_dict().items()},
                     "warned": [str(w.message) for w in caught if "started from different weights" in str(w.message)],
                     "bytes": state.meter.bytes()}
    return out


def test_ranks_that_start_apart_start_from_the_first_ranks_weights():
    """Never a silent average of different starts: rank 0's weights and buffers are broadcast (as DDP's
    constructor does), a warning says so on every rank; ranks that start equal cost no byte and no warning."""
    r0, r1 = run_ranks(_starts, 2)
    for name in ("qsr", "ab"):
        assert any(not torch.equal(r0[name]["before"][k], r1[name]["before"][k]) for k in r0[name]["before"])
        for k, v in r0[name]["before"].items():
            assert torch.equal(r0[name]["after"][k], v) and torch.equal(r1[name]["after"][k], v), (name, k)
        for r in (r0, r1):
            assert len(r[name]["warned"]) == 1 and "torch.manual_seed" in r[name]["warned"][0], r[name]["warned"]
    for r in (r0, r1):
        assert r["qsr-seeded"]["warned"] == [] and r["qsr-seeded"]["bytes"] == 0, r["qsr-seeded"]


def _plain_into_outer(rank, world, ckdir):
    net = DDP(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = commhooks.ddp.register(net, opt, {"type": "qsr", "h_base": 2})
    for step in range(2):
        opt.zero_grad()
        net(torch.randn(4, 6)).sum().backward()
        opt.step()
    commhooks.save_checkpoint(ckdir, net, opt, state)
    other = DDP(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), forward_sync_buffers=False)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    outer = commhooks.ddp.register(other, other_opt, {"type": "qsr", "h_base": 2, "outer_lr": 0.7})
    try:
        commhooks.load_checkpoint(ckdir, other, other_opt, outer)
    except commhooks.CheckpointError as exc:
        return str(exc)
    return None


def test_a_plain_checkpoint_loaded_into_an_outer_step_run_names_the_file_and_the_fix(tmp_path):
    for rank, said in enumerate(run_ranks(_plain_into_outer, 2, ckdir=str(tmp_path))):
        assert said is not None and f"step-00000002/rank{rank}.pt" in said, said
        assert "holds no outer-step state" in said and "resume with the config it was saved with" in said, said


def test_the_step_proof_is_float32_whatever_the_default_dtype():
    """The proof rides in a float32 call and is read back as float32 bytes (the allgather's packed payload): it must
    not follow ``torch.set_default_dtype(torch.float64)``."""
    from commhooks.algorithms.contract.steps import STEP_PROOF_BYTES, NonfiniteGuard, step_proof

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for scale in (None, 2.0 ** 16, torch.tensor(1024.0)):
            proof = step_proof(7, scale)
            assert proof.dtype == torch.float32 and 4 * proof.numel() == STEP_PROOF_BYTES, (scale, proof.dtype)
        assert NonfiniteGuard(["w"]).indicator(torch.device("cpu")).dtype == torch.float32
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("hook", ["qsr", "ab"])
def test_a_rank_whose_peer_left_says_so_itself(hook):
    """Uneven inputs, no Join, the short rank's process ends: the rank still training stops with the collective
    named and "a peer left the job", at a QSR sync and in AB's gradient mean through DDP's hook (which handed the
    local gradient back as the mean, silently, before)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(repo / "tests" / "scripts" / "uneven_leave.py"), hook], env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank 0: finished 10 steps" in out and "rank 1: finished" not in out, out[-3000:]
    assert "a peer left the job" in out and "Join" in out, out[-3000:]
