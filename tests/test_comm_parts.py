"""The collaborators of :class:`commhooks.comm.Comm` (issue #51), through a fake two-rank backend in one process:
each collective is metered, named when it fails and averaged exactly as before they were split out of it."""

import pytest
import torch

from commhooks.comm import CollectiveError, Comm
from commhooks.comm.base import Meter, Work  # still importable where callers found them


class Mirror(Comm):
    """Rank 0 of two whose peer holds the same tensors: a sum doubles, a max and a broadcast keep them."""

    def __init__(self, native=False, fail=None, timeout_s=None, size=2):
        self.native, self.fail, self.sent = native, fail, []
        super().__init__(0, size, timeout_s)

    def _default_device(self):
        return torch.device("cpu", 0)  # not what a CPU tensor reports ("cpu"): an adopted device shows

    def _native_mean(self, flat, group):
        return self.native

    def _allreduce_flat(self, flat, op, group, async_op, key=None):
        self.sent.append((op, flat.clone(), key))
        if self.fail == "start":
            raise RuntimeError("boom")
        if op in ("sum", "mean"):
            flat.mul_(2 if op == "sum" else 1)

        def wait():
            if self.fail == "wait":
                raise RuntimeError("peer gone")

        return wait, None

    def _broadcast_flat(self, flat, src, group):
        if self.fail == "start":
            raise RuntimeError("boom")

    def _allgather_flat(self, flat, group):
        def wait():
            if self.fail == "wait":
                raise RuntimeError("peer gone")
            return torch.cat([flat, flat])

        return wait

    def _alltoall_flat(self, flat, group):
        return lambda: flat.clone()


def test_means_divide_half_dtypes_first_others_after_native_not_at_all():
    comm = Mirror()
    half = [torch.full((3,), 4.0, dtype=torch.float16)]
    comm.allreduce(half)
    assert comm.sent[-1][0] == "sum" and comm.sent[-1][1].tolist() == [2.0] * 3  # divided before the sum
    assert half[0].tolist() == [4.0] * 3
    full = [torch.full((3,), 4.0)]
    comm.allreduce(full)
    assert comm.sent[-1][0] == "sum" and comm.sent[-1][1].tolist() == [4.0] * 3 and full[0].tolist() == [4.0] * 3
    native = Mirror(native=True)
    native.allreduce([torch.ones(2)])
    assert native.sent[-1][0] == "mean"
    with pytest.raises(ValueError, match="op must be one of"):
        comm.allreduce([torch.ones(1)], op="min")


def test_every_collective_is_metered_as_before():
    comm = Mirror()
    comm.allreduce([torch.ones(2, 3), torch.ones(4)], tag="grad")
    comm.allreduce([torch.ones(1)], tag="check", metered=False)
    comm.broadcast([torch.ones(5)], src=0, tag="sync")
    comm.broadcast([torch.ones(5)], src=1, tag="sync")  # the receiving end is not counted
    gathered = comm.allgather(torch.ones(2, 2, dtype=torch.int8), tag="codes")
    pieces = comm.alltoall(torch.arange(6.0), tag="ex", async_op=True).wait()
    assert comm.meter.snapshot() == {"world/allgather/codes": {"bytes": 4, "calls": 1},
                                     "world/allreduce/grad": {"bytes": 40, "calls": 1},
                                     "world/alltoall/ex": {"bytes": 24, "calls": 1},
                                     "world/broadcast/sync": {"bytes": 20, "calls": 1}}
    assert [g.shape for g in gathered] == [(2, 2), (2, 2)] and [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("fail", ["start", "wait"])
def test_a_failure_names_the_call(fail):
    comm = Mirror(fail=fail, timeout_s=5)
    with pytest.raises(CollectiveError) as caught:
        comm.allreduce([torch.ones(4)], tag="grad", async_op=True).wait()
    cause = "boom" if fail == "start" else "peer gone"
    assert str(caught.value) == (f"commhooks allreduce 'grad' of 16 bytes on group world (ranks [0, 1]), rank 0 "
                                 f"(timeout 5 s) failed: {cause}")
    if fail == "start":
        with pytest.raises(CollectiveError, match=r"^commhooks broadcast 'untagged' of 4 bytes .* failed: boom$"):
            comm.broadcast([torch.ones(1)])
    else:
        with pytest.raises(CollectiveError, match=r"^commhooks allgather 'x' of 8 bytes .*timeout 5 s\) failed: peer"):
            comm.allgather(torch.ones(2), tag="x")


def test_keys_and_the_control_device():
    comm = Mirror()
    with comm.keyed("a.weight"):
        comm.allreduce([torch.ones(1)])
        with comm.keyed("b"):
            comm.allreduce([torch.ones(1)])
        comm.allreduce([torch.ones(1)], key="own")
    comm.allreduce([torch.ones(1)])
    assert [s[2] for s in comm.sent] == ["a.weight", "b", "own", None]
    fresh = Mirror()
    assert fresh.device == torch.device("cpu", 0)
    fresh.barrier()  # a control tensor is not adopted as the synced tensors' device
    assert fresh.device == torch.device("cpu", 0)
    fresh.allreduce([torch.ones(1)])  # the first synced tensors are
    assert fresh.device == torch.device("cpu")
    fresh.device = "meta"
    assert fresh.device == torch.device("meta")
    fresh.device = None
    assert fresh.device == torch.device("cpu", 0)


def test_groups_are_made_once_and_checked():
    made = []

    class Grouping(Mirror):
        def _make_group(self, ranks):
            made.append(ranks)
            return object()

    comm = Grouping(size=3)
    g = comm.new_group([1, 0])
    assert comm.new_group((0, 1)) is g and made == [(0, 1)] and g.name == "g0-1" and g.member
    assert comm.new_group([1, 0], name="other") is g  # cached by ranks, as before
    other = comm.new_group([2, 1], name="pair")
    assert other.name == "pair" and not other.member and made == [(0, 1), (1, 2)]
    assert comm.new_group(range(3)) is comm.world and comm.world.ranks == (0, 1, 2) and comm.world.name == "world"
    with pytest.raises(ValueError, match=r"distinct ranks in \[0, 3\)"):
        comm.new_group([0, 0])
    with pytest.raises(ValueError, match=r"distinct ranks in \[0, 3\)"):
        comm.new_group([3])


def test_a_collective_reads_one_module_of_comm():
    """Everything a collective runs through (the Comm, its Call, the Meter, Work, flatten) is in comm/base.py, as
    the sync trace (tests/test_sync_trace.py) counts files; the package re-exports the same objects."""
    import commhooks.comm as comm_package
    from commhooks.comm import base

    assert Meter is base.Meter is comm_package.Meter and Work is base.Work is comm_package.Work
    assert {type(Mirror(size=2)).__mro__[1].__module__, Meter.__module__, Work.__module__} == {"commhooks.comm.base"}
