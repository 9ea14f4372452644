"""DiLoCo-style syncs: the outer optimizer, compressed payloads (bf16, int8), error feedback, exact resume."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import payload
from commhooks.algorithms.contract import STEP_PROOF_BYTES
from commhooks.algorithms.qsr.sync import FragmentSync
from commhooks.comm.torch_dist import TorchComm
from commhooks.config import ConfigError, load_config
from commhooks.algorithms.traffic import Send
from tests.declared import declared
from tests.dist import run_ranks

pytestmark = pytest.mark.xdist_group("test_outer")  # its module fixtures are built once, on one worker

SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 12, generator=g)
    return x, x[:, :3].argmax(1)


def _qsr_run(config, steps, resume_at=None, outer_optimizer=None, via_register=False):
    """QSR through the DDP adapter; ``resume_at``: save there, rebuild everything, load, go on.
    ``outer_optimizer``: the state built by hand with it (the documented two lines), or (``via_register``) handed
    through ``commhooks.ddp.register``."""
    def build():
        net = DDP(_net(), forward_sync_buffers=False)
        opt = torch.optim.SGD(net.parameters(), **SGD)
        if outer_optimizer is None or via_register:
            options = {} if outer_optimizer is None else {"outer_optimizer": outer_optimizer}
            return net, opt, commhooks.ddp.register(net, opt, config, **options)
        state = commhooks.QSRState(opt, model=net, outer_optimizer=outer_optimizer, config=config)
        net.register_comm_hook(state, commhooks.comm_hook)
        return net, opt, state

    net, opt, state = build()
    rank = dist.get_rank()
    for step in range(steps):
        if step == resume_at:
            saved = ({k: v.clone() for k, v in net.state_dict().items()}, opt.state_dict(), state.state_dict())
            net, opt, state = build()
            net.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
        opt.zero_grad()
        x, y = _batch(step, rank)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in net.module.named_parameters()}, state


def _reference(steps, period, lr, mu):
    """Local SGD written out: every rank trains alone; every ``period`` steps the pseudo-gradients are averaged
    (gathered by hand) and the anchor takes a Nesterov outer step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = _net()
    opt = torch.optim.SGD(net.parameters(), **SGD)
    params = list(net.parameters())
    anchor = [p.detach().clone() for p in params]
    buf = None
    for step in range(steps):
        opt.zero_grad()
        x, y = _batch(step, rank)
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if (step + 1) % period == 0:
            flat = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(anchor, params)])
            every = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(every, flat)
            d = sum(every) / world
            buf = d.clone() if buf is None else mu * buf + d
            step_ = d + mu * buf
            new = torch.cat([a.reshape(-1) for a in anchor]) - lr * step_
            offset = 0
            for a, p in zip(anchor, params):
                a.copy_(new[offset: offset + a.numel()].view_as(a))
                p.data.copy_(a)
                offset += a.numel()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _worker(rank, world):
    out = {}
    comm = TorchComm()
    # 1. lr 1 / momentum 0: the outer step is plain averaging
    torch.manual_seed(rank)
    local = [torch.randn(5, 3), torch.randn(7)]
    before = torch.cat([t.reshape(-1) for t in local])
    outer = FragmentSync(1.0, 0.0, True, "fp32", 256, False)
    outer.anchor = torch.full((22,), 0.25)
    outer.sync(comm, local, torch.zeros(9))  # local becomes anchor - mean(anchor - local_i)
    out["plain"] = (before, torch.cat([t.reshape(-1) for t in local]))
    # 2. Nesterov outer step, end to end through the DDP adapter, against the reference above
    conf = {"type": "qsr", "h_base": 3, "alpha": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "total_steps": 9}
    out["nesterov"] = (_qsr_run(conf, 9)[0], _reference(9, 3, 0.7, 0.9))
    # 3. compressed payloads: exact meter bytes
    numel = sum(p.numel() for p in _net().parameters())
    for codec in ("bf16", "int8"):
        conf = {"type": "qsr", "h_base": 3, "alpha": 0.0, "payload": codec, "error_feedback": True, "total_steps": 9}
        weights, state = _qsr_run(conf, 9)
        out[codec] = {"tags": state.meter.by_tag(), "numel": numel, "syncs": state.syncs,
                      "residual": state.driver.fragments[0].residual.clone(), "weights": weights}
    # 4. exact resume mid-round, with momentum and error feedback state
    conf = {"type": "qsr", "h_base": 3, "alpha": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9, "payload": "int8",
            "error_feedback": True, "total_steps": 12}
    out["resume"] = (_qsr_run(conf, 12)[0], _qsr_run(conf, 12, resume_at=7)[0])
    # 4b. any torch.optim optimizer as the outer step: torch's SGD with Nesterov takes the built-in's steps, and its
    # state resumes exactly; Adam runs and keeps the ranks identical
    nesterov = lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)  # noqa: E731
    plain = {"type": "qsr", "h_base": 3, "alpha": 0.0, "payload": "int8", "error_feedback": True, "total_steps": 12}
    out["torch_outer"] = (out["resume"][0], _qsr_run(plain, 12, outer_optimizer=nesterov)[0],
                          _qsr_run(plain, 12, resume_at=7, outer_optimizer=nesterov)[0])
    weights, state = _qsr_run({**plain, "payload": "fp32", "error_feedback": False}, 9,
                              outer_optimizer=lambda ps: torch.optim.Adam(ps, lr=0.01), via_register=True)
    out["adam_outer"] = (weights, state.syncs, state.memory().get("outer_optimizer", 0))
    try:  # a misspelt option beside the config: named, on every rank, before any collective of the state
        net = DDP(_net(), forward_sync_buffers=False)
        commhooks.ddp.register(net, torch.optim.SGD(net.parameters(), lr=0.1), plain, outer_optimiser=nesterov)
        out["bad_option"] = ""
    except ConfigError as exc:
        out["bad_option"] = str(exc)
    # 5. error feedback: the residual is exactly what the codec lost, and rides in the next delta
    torch.manual_seed(10 + rank)
    tensors = [torch.randn(300)]
    ef = FragmentSync(1.0, 0.0, True, "int8", 64, True)
    ef.anchor = torch.zeros(300)
    delta = ef.anchor - tensors[0]
    ef.sync(comm, tensors, torch.zeros(9))
    out["ef_first"] = (ef.residual.clone(), delta - payload.round_trip(delta, "int8", 64))
    # 5b. error_feedback_decay (SparseLoCo's beta): the next delta carries 0.5 x the residual
    decayed = FragmentSync(1.0, 0.0, True, "int8", 64, True, feedback_decay=0.5)
    decayed.anchor, tensors = torch.zeros(300), [torch.randn(300)]
    decayed.sync(comm, tensors, torch.zeros(9))
    first = decayed.residual.clone()
    tensors[0].add_(torch.randn(300))  # local steps after the sync
    delta = (decayed.anchor - tensors[0]).add_(first, alpha=0.5)
    decayed.sync(comm, tensors, torch.zeros(9))
    out["ef_decay"] = (first, decayed.residual.clone(), delta - payload.round_trip(delta, "int8", 64))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, world_size=2, timeout=240)


def test_outer_lr1_momentum0_is_plain_averaging(results):
    mean = sum(r["plain"][0] for r in results) / 2
    for r in results:  # every rank now holds the plain mean of the ranks' tensors
        assert torch.allclose(r["plain"][1], mean, atol=1e-6)


def test_nesterov_outer_step_equals_reference(results):
    for r in results:
        hooked, reference = r["nesterov"]
        for n in hooked:
            assert torch.allclose(hooked[n], reference[n], atol=1e-5, rtol=1e-4), (n, (hooked[n] - reference[n]).abs().max())
    assert all(torch.equal(results[0]["nesterov"][0][n], results[1]["nesterov"][0][n]) for n in results[0]["nesterov"][0])


def test_meter_counts_compressed_bytes_exactly(results):
    for r in results:
        assert r["bf16"]["syncs"] == r["int8"]["syncs"] == 3
        for codec in ("bf16", "int8"):  # the meter's bytes by tag are those QSR declares: the anchor, 3 payloads
            conf = {"type": "qsr", "h_base": 3, "alpha": 0.0, "payload": codec, "error_feedback": True, "total_steps": 9}
            traffic = declared(conf, _net(), steps=9)
            assert r[codec]["tags"] == traffic.by_tag() and traffic.syncs == 3 and traffic.calls(tag="sync") == 3
            assert traffic.sync == (Send("allgather", STEP_PROOF_BYTES + payload.payload_nbytes(r[codec]["numel"], codec),
                                         "sync"),)
        assert r["int8"]["residual"].abs().max() > 0  # error feedback kept what int8 lost
    for codec in ("bf16", "int8"):  # every rank decodes the same mean: identical weights after the last sync
        a, b = results[0][codec]["weights"], results[1][codec]["weights"]
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_exact_resume_with_outer_state(results):
    for r in results:
        straight, resumed = r["resume"]
        assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_any_torch_optimizer_takes_the_outer_step(results):
    for r in results:
        builtin, torch_sgd, resumed = r["torch_outer"]
        for n in builtin:  # the same Nesterov steps, to rounding (torch fuses lr * step into the update)
            assert torch.allclose(builtin[n], torch_sgd[n], atol=1e-6, rtol=1e-5), (n, (builtin[n] - torch_sgd[n]).abs().max())
        assert all(torch.equal(torch_sgd[k], resumed[k]) for k in torch_sgd)  # its state rides in the checkpoint
        weights, syncs, kept = r["adam_outer"]
        assert syncs == 3 and kept == 2 * 4 * sum(w.numel() for w in weights.values())  # exp_avg, exp_avg_sq
    a, b = results[0]["adam_outer"][0], results[1]["adam_outer"][0]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_outer_optimizer_refuses_the_built_in_keys():
    net = _net()
    for keys, named in (({"outer_lr": 0.7}, r"qsr.outer_lr \(0.7\): the built-in"),
                        ({"outer_lr": 1.0}, r"qsr.outer_lr \(1.0\): the built-in"),  # the default, given: refused too
                        ({"outer_momentum": 0.9, "outer_nesterov": False},
                         r"^qsr.outer_momentum \(0.9\), qsr.outer_nesterov \(False\): the built-in")):
        with pytest.raises(ConfigError, match=named):
            commhooks.QSRState(torch.optim.SGD(net.parameters(), lr=0.1), model=net, **keys,
                               outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.7))


def test_error_feedback_carries_the_residual(results):
    for r in results:
        got, expected = r["ef_first"]
        assert torch.equal(got, expected) and got.abs().max() > 0
        first, got, expected = r["ef_decay"]  # SparseLoCo's decayed residual: half of it joined the second delta
        assert first.abs().max() > 0 and torch.equal(got, expected)


@pytest.mark.parametrize("codec, bound", [("bf16", "relative"), ("int8", "block")])
def test_round_trip_error_is_bounded_as_documented(codec, bound):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10_000, generator=g) * torch.logspace(-4, 2, 10_000)  # values across six decades
    back = payload.round_trip(x, codec, 256)
    err = (back - x).abs()
    if bound == "relative":
        assert bool((err <= x.abs() * 2.0 ** -8 + 1e-30).all())
    else:
        absmax = torch.nn.functional.pad(x, (0, (-x.numel()) % 256)).view(-1, 256).abs().amax(1)
        limit = absmax.repeat_interleave(256)[: x.numel()] / 254
        assert bool((err <= limit * (1 + 1e-5)).all())
    assert payload.encode(x, codec, 256).numel() == payload.payload_nbytes(x.numel(), codec, 256)


@pytest.mark.parametrize("key, value", [("outer_lr", 0.0), ("outer_momentum", 1.0), ("outer_momentum", -0.1),
                                        ("payload", "fp8"), ("payload_block", 4), ("error_feedback", "yes"),
                                        ("outer_nesterov", 1)])
def test_every_new_key_has_a_config_error(key, value):
    with pytest.raises(ConfigError, match=f"qsr.{key}"):
        load_config({"type": "qsr", key: value})


def test_register_passes_state_options_and_names_a_wrong_one(results):
    for r in results:  # the Adam run above came through commhooks.ddp.register(..., outer_optimizer=...)
        assert r["adam_outer"][2] > 0  # its state was kept: the option reached the state
        assert "QSRState takes no 'outer_optimiser'" in r["bad_option"], r["bad_option"]
