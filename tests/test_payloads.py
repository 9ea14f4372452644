"""Sub-byte and sparse sync payloads (int4, int2, top-k), stochastic rounding, and the period-aware outer step.

* each codec's round-trip error within its documented bound, its byte count exact, top-k equal to a written-out
  per-chunk top-k, stochastic rounding unbiased;
* through the DDP adapter on 2 gloo ranks: the meter's bytes exact per sync, the ranks identical after every
  sync, error feedback carrying exactly what the codec lost, resume exact (stochastic rounding included);
* ``outer_normalize="lr_sum"`` equal to a written-out outer step whose momentum sees the pseudo-gradient per
  unit of inner lr; without momentum it would change nothing, so it is refused.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import payload
from commhooks.algorithms.contract import STEP_PROOF_BYTES
from commhooks.payload import Codec
from commhooks.algorithms.traffic import Send
from tests.declared import declared
from tests.dist import run_ranks

pytestmark = pytest.mark.xdist_group("test_payloads")  # its module fixtures are built once, on one worker


def _x(n=10_000, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-3, 1, n)  # values across four decades


@pytest.mark.parametrize("name, q", [("int8", 127), ("int4", 7), ("int2", 1)])
def test_dense_codecs_round_trip_within_their_bound(name, q):
    x = _x()
    absmax = torch.nn.functional.pad(x, (0, (-x.numel()) % 128)).view(-1, 128).abs().amax(1)
    scale = (absmax / q).repeat_interleave(128)[: x.numel()]
    codec = Codec(name, 128)
    data = codec.encode(x)
    assert data.numel() == codec.nbytes(x.numel()) == math.ceil(x.numel() * {127: 8, 7: 4, 1: 2}[q] / 8) + 4 * 79
    err = (codec.decode(data, x.numel()) - x).abs()
    assert bool((err <= scale / 2 * (1 + 1e-5)).all())  # round to nearest: half a step
    stochastic = Codec(name, 128, rounding="stochastic")
    err = (stochastic.decode(stochastic.encode(x, seed=7), x.numel()) - x).abs()
    assert bool((err < scale * (1 + 1e-5)).all())  # stochastic: below one step
    assert torch.equal(stochastic.encode(x, seed=7), stochastic.encode(x, seed=7))  # seeded: a resume redraws it


def test_stochastic_rounding_is_unbiased():
    x = torch.full((256,), 0.3) * torch.linspace(-1, 1, 256)  # every value between two int2 levels
    codec = Codec("int2", 256, rounding="stochastic")
    mean = torch.stack([codec.decode(codec.encode(x, seed=s), 256) for s in range(400)]).mean(0)
    nearest = Codec("int2", 256).decode(Codec("int2", 256).encode(x), 256)
    assert (mean - x).abs().max() < 0.05 < (nearest - x).abs().max()  # rounding to nearest is biased here


@pytest.mark.parametrize("values", ["fp32", "int8", "int4"])
def test_topk_equals_a_written_out_per_chunk_topk(values):
    x = _x(1000)
    codec = Codec("topk", density=0.05, chunk=64, values=values)
    data = codec.encode(x)
    k, chunks = math.ceil(0.05 * 64), math.ceil(1000 / 64)
    value_bytes = {"fp32": 4 * chunks * k, "int8": chunks * k + 4 * chunks,
                   "int4": math.ceil(chunks * k / 2) + 4 * chunks}[values]
    assert data.numel() == codec.nbytes(1000) == 2 * chunks * k + value_bytes
    reference = torch.zeros(chunks * 64)
    padded = torch.nn.functional.pad(x, (0, chunks * 64 - 1000))
    for c in range(chunks):
        row = padded[c * 64:(c + 1) * 64]
        idx = row.abs().topk(k).indices
        reference[c * 64 + idx] = row[idx]
    back = codec.decode(data, 1000)
    if values == "fp32":
        assert torch.equal(back, reference[:1000])
    else:  # the chosen places, their values within the value codec's bound (one scale per chunk)
        assert torch.equal(back != 0, reference[:1000] != 0)
        q = {"int8": 127, "int4": 7}[values]
        assert (back - reference[:1000]).abs().max() <= reference.abs().max() / (2 * q) * (1 + 1e-5)


# --------------------------------------------------------------------------
# through the DDP adapter, 2 ranks
# --------------------------------------------------------------------------

CONFIGS = {
    "int4": {"payload": "int4", "payload_block": 64},
    "int2-stochastic": {"payload": "int2", "payload_block": 64, "payload_rounding": "stochastic"},
    "topk": {"payload": "topk", "topk_density": 0.05, "topk_chunk": 64},
    "topk-int4-values": {"payload": "topk", "topk_density": 0.05, "topk_chunk": 64, "topk_values": "int4",
                         "payload_rounding": "stochastic"},
}


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=g, device="cpu"), torch.randint(0, 3, (8,), generator=g, device="cpu")


def _run(conf, steps, rank, resume_at=None, lr_at=None):
    net = DDP(_net(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = commhooks.ddp.register(net, opt, conf)
    after_sync = []
    for step in range(steps):
        if lr_at is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        if resume_at == step:  # fresh objects from this rank's state
            saved = (net.module.state_dict(), opt.state_dict(), state.state_dict())
            net = DDP(_net(), forward_sync_buffers=False)
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            state = commhooks.ddp.register(net, opt, conf)
            net.module.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
            if lr_at is not None:
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        syncs = state.syncs
        opt.step()
        if state.syncs != syncs:
            after_sync.append(float(sum(p.detach().double().sum() for p in net.module.parameters())))
    return net, state, after_sync


def _through_ddp(rank, world):
    out = {}
    n = sum(p.numel() for p in _net().parameters())
    for name, extra in CONFIGS.items():
        conf = {"type": "qsr", "h_base": 3, "error_feedback": True, "total_steps": 12, "check_every": 1, **extra}
        net, state, after_sync = _run(conf, 12, rank)
        codec = commhooks.load_config(conf).codec
        resumed, _, _ = _run(conf, 12, rank, resume_at=7)
        out[name] = {"tags": state.meter.by_tag(), "syncs": state.syncs, "nbytes": codec.nbytes(n), "n": n,
                     "after_sync": after_sync,
                     "resume_exact": all(torch.equal(a, b) for a, b in zip(net.module.parameters(),
                                                                         resumed.module.parameters()))}
    # AB x QSR's world syncs in int4 and top-k: identical ranks after each sync
    for name, extra in (("ab-int4", CONFIGS["int4"]), ("ab-topk", CONFIGS["topk"])):
        conf = {"type": "ab", "warmup_steps": 2, "sync_period": 4, "sync_rule": "qsr", "h_base": 4, "alpha": 1e-9,
                "full_rank_steps": 1, "group_size": 1, "min_compression_rate": 1.01, "rank_cutoff": 0.8,
                "total_steps": 12, "check_every": 1, **extra}
        _, state, after_sync = _run(conf, 12, rank)
        out[name] = {"after_sync": after_sync, "sync_bytes": state.meter.by_tag().get("sync", 0)}
    # error feedback: after a sync the residual is exactly what the codec lost of that sync's pseudo-gradient
    from commhooks.algorithms.qsr.sync import FragmentSync
    from commhooks.comm.torch_dist import TorchComm

    comm = TorchComm()
    out["residual"] = {}
    for name in ("int4", "int2-stochastic", "topk"):
        codec = commhooks.load_config({"type": "qsr", **CONFIGS[name]}).codec
        torch.manual_seed(10 + rank)
        tensors = [torch.randn(300)]
        ef = FragmentSync(1.0, 0.0, True, codec, codec.block, True)
        ef.anchor = torch.zeros(300)
        delta = ef.anchor - tensors[0]
        ef.sync(comm, tensors, torch.zeros(commhooks.algorithms.contract.steps.PROOF_ELEMENTS), seed=5)
        out["residual"][name] = (ef.residual.clone(), delta - payload.round_trip(delta, codec, seed=5))
    # the period-aware outer step against a written-out one
    lr_at = lambda step: 0.2 * (1 - step / 24) ** 2 + 1e-3  # noqa: E731  decays: QSR's periods grow
    rule = {"type": "qsr", "h_base": 2, "alpha": 0.08, "outer_lr": 0.7, "outer_momentum": 0.9, "total_steps": 24}
    net, state, _ = _run({**rule, "outer_normalize": "lr_sum"}, 24, rank, lr_at=lr_at)
    out["lr_sum"] = ([p.detach().clone() for p in net.module.parameters()], list(state.sync_steps),
                     _reference_lr_sum(rank, world, 24, list(state.sync_steps), lr_at))
    try:  # without momentum the step it scales back is the pseudo-gradient itself: refused, as changing nothing
        _run({**rule, "outer_momentum": 0.0, "outer_normalize": "lr_sum"}, 24, rank, lr_at=lr_at)
        out["lr_sum_without_momentum"] = "accepted"
    except commhooks.ConfigError as exc:
        out["lr_sum_without_momentum"] = str(exc)
    return out


def _reference_lr_sum(rank, world, steps, sync_steps, lr_at, lr=0.7, mu=0.9):
    """Local SGD whose syncs are Nesterov outer steps on the pseudo-gradient per unit of inner lr."""
    import torch.distributed as dist

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    params = list(net.parameters())
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in params])  # noqa: E731
    anchor = flat()
    dist.all_reduce(anchor)
    anchor /= world
    buf, lr_sum = None, 0.0
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        lr_sum += lr_at(step)
        if step == 0:
            _write(params, anchor)
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if step + 1 in sync_steps:
            delta = anchor - flat()
            dist.all_reduce(delta)
            d = delta / world / lr_sum
            buf = d.clone() if buf is None else mu * buf + d
            anchor = anchor - lr * lr_sum * (d + mu * buf)
            _write(params, anchor)
            lr_sum = 0.0
    return [p.detach().clone() for p in params]


def _write(params, flat):
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset: offset + p.numel()].view_as(p))
            offset += p.numel()


@pytest.fixture(scope="module")
def through_ddp():
    return run_ranks(_through_ddp, 2, timeout=240)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_payloads_through_ddp_exact_bytes_identical_ranks_exact_resume(through_ddp, name):
    r0, r1 = through_ddp[0][name], through_ddp[1][name]
    assert r0["syncs"] == 4, r0
    conf = {"type": "qsr", "h_base": 3, "error_feedback": True, "total_steps": 12, "check_every": 1, **CONFIGS[name]}
    traffic = declared(conf, _net())
    assert r0["tags"] == r1["tags"] == traffic.by_tag(), r0["tags"]  # the meter counts what QSR declares
    assert traffic.sync == (Send("allgather", STEP_PROOF_BYTES + r0["nbytes"], "sync"),) and traffic.syncs == 4
    assert r0["after_sync"] == r1["after_sync"]  # identical after every sync (check_every=1 checked it too)
    assert r0["resume_exact"] and r1["resume_exact"]


@pytest.mark.parametrize("name", ["ab-int4", "ab-topk"])
def test_ab_x_qsr_world_syncs_in_sub_byte_and_sparse_payloads(through_ddp, name):
    r0, r1 = through_ddp[0][name], through_ddp[1][name]
    assert len(r0["after_sync"]) >= 2 and r0["after_sync"] == r1["after_sync"], (r0, r1)
    assert 0 < r0["sync_bytes"]


@pytest.mark.parametrize("name", ["int4", "int2-stochastic", "topk"])
def test_error_feedback_keeps_exactly_what_the_codec_lost(through_ddp, name):
    for r in through_ddp:
        got, expected = r["residual"][name]
        assert torch.equal(got, expected) and got.abs().max() > 0


def test_period_aware_outer_step_equals_the_written_out_one(through_ddp):
    for r in through_ddp:
        got, sync_steps, want = r["lr_sum"]
        gaps = {b - a for a, b in zip([0] + sync_steps[:-1], sync_steps)}
        assert len(gaps) >= 2, sync_steps  # the rule's periods changed: the normalisation mattered
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        assert r["lr_sum_without_momentum"].startswith("qsr.outer_normalize 'lr_sum' has no effect here"), r
