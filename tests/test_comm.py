"""The Comm layer over real gloo groups: reductions, subgroups, async, broadcast, and the meter."""

import pytest
import torch

from commhooks.comm import Meter
from tests.dist import run_ranks


def _collectives(rank, world):
    from commhooks.comm import TorchComm

    comm = TorchComm()
    a = torch.full((3,), float(rank + 1))
    b = torch.arange(4.0).reshape(2, 2) * (rank + 1)
    comm.allreduce([a, b], op="mean")  # one flat call for both
    s = torch.tensor([float(rank + 1)])
    comm.allreduce([s], op="sum")
    m = torch.tensor([float(rank * 10)])
    comm.allreduce([m], op="max", tag="probe")
    work = comm.allreduce([torch.full((5,), float(rank))], op="sum", async_op=True, tag="async")
    w = work.wait()[0]
    fut_val = comm.allreduce([torch.ones(2) * rank], op="mean", async_op=True).future().wait()[0]
    singles = [comm.new_group([r]) for r in range(world)]  # collective: same order on every rank
    solo = comm.new_group([rank])  # cached: no second dist.new_group
    assert solo is singles[rank] and solo.member and not singles[1 - rank].member
    x = torch.tensor([float(rank + 5)])
    comm.allreduce([x], group=solo, op="mean")  # a one-rank group is a no-op
    bc = torch.tensor([float(rank + 7)])
    comm.broadcast([bc], src=1)
    return {
        "a": a, "b": b, "s": s, "m": m, "w": w, "fut": fut_val, "x": x, "bc": bc,
        "bytes": comm.meter.bytes(), "calls": comm.meter.calls(),
        "probe": comm.meter.bytes(tag="probe"), "world_calls": comm.meter.calls(group="world", kind="allreduce"),
        "bcast": comm.meter.bytes(kind="broadcast"),
    }


def test_collectives_and_meter():
    r0, r1 = run_ranks(_collectives, 2)
    for r in (r0, r1):
        assert torch.equal(r["a"], torch.full((3,), 1.5))
        assert torch.equal(r["b"], torch.arange(4.0).reshape(2, 2) * 1.5)
        assert r["s"].item() == 3.0 and r["m"].item() == 10.0
        assert torch.equal(r["w"], torch.ones(5)) and torch.equal(r["fut"], torch.full((2,), 0.5))
        assert r["bc"].item() == 8.0
        assert r["probe"] == 4
        assert r["world_calls"] == 5  # mean, sum, max, async, future
    assert r0["x"].item() == 5.0 and r1["x"].item() == 6.0
    # payload: (3+4) + 1 + 1 + 5 + 2 floats allreduced; the one-rank group sends nothing
    assert r0["bytes"] - r0["bcast"] == (7 + 1 + 1 + 5 + 2) * 4
    assert r0["bcast"] == 0 and r1["bcast"] == 4  # a broadcast is counted at its source
    assert r0["calls"] == 5 and r1["calls"] == 6


def test_meter_filters_and_reset():
    m = Meter()
    m.record("world", "allreduce", 100, "grad")
    m.record("g0-1", "allreduce", 10, "sync")
    m.record("world", "broadcast", 1, "sync")
    assert m.bytes() == 111 and m.calls() == 3
    assert m.bytes(group="world") == 101 and m.bytes(tag="sync") == 11 and m.bytes(kind="broadcast") == 1
    assert m.by_tag() == {"grad": 100, "sync": 11}
    assert m.snapshot()["world/allreduce/grad"] == {"bytes": 100, "calls": 1}
    m.reset()
    assert m.bytes() == 0 and m.calls() == 0


def test_comm_needs_initialised_process_group():
    from commhooks.comm import TorchComm

    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchComm()


def _device_of_a_comm_without_state(rank, world):
    from commhooks.comm import TorchComm

    comm = TorchComm()  # no state names the synced tensors' device
    before = str(comm.device)
    comm.allreduce([torch.empty(3, device="meta")])  # a one-rank group: nothing is sent, the device is taken
    return before, str(comm.device)


def test_a_comm_without_a_state_takes_the_synced_tensors_device():
    """Not ``torch.cuda.current_device()``: that is cuda:0 on every rank that never called set_device, and an
    NCCL group would then pair every rank's control tensors with GPU 0.  (Here the tensors are on ``meta``, a
    device the CPU has and gloo's default is not.)"""
    (before, after), = run_ranks(_device_of_a_comm_without_state, 1)
    assert (before, after) == ("cpu", "meta")
