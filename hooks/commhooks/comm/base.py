"""The collective interface every algorithm talks to (:class:`Comm`), and what comes with it.

Algorithms in commhooks never call ``torch.distributed`` or Horovod directly: they call a :class:`Comm`.  That
keeps them backend-agnostic (the same code runs under DDP, Horovod and DeepSpeed) and lets one place count the
traffic.  A backend implements a few primitives on a single contiguous tensor (``_allreduce_flat``,
``_broadcast_flat``, ``_allgather_flat``, ``_alltoall_flat``, ``_make_group``); this module does the rest, each
concern a small class the :class:`Comm` hands its calls to: :func:`flatten` (a list of tensors as one buffer, one
call on the wire, as DDP's buckets do) and :class:`Work` (an in-flight collective); the :class:`Meter` (bytes per
group, collective and tag); one :class:`Call` per collective (it meters the call and names it when it fails);
a :class:`Reduction` per allreduce (who divides a mean); :class:`Groups` (the groups made).  They share one
module because a sync runs through every one of them (``tests/test_sync_trace.py`` counts the files it reads).

**Device.**  ``Comm.device`` is where the library makes the tensors it hands to a collective of its own
(handshakes, step proofs, agreements, checksums): the device of the tensors the algorithm syncs (the state sets
it when it is built; a Comm used on its own takes the device of the first tensors it is handed).  An NCCL-only
process group (``init_process_group("nccl")``, as in PyTorch's DDP tutorial) refuses CPU tensors, so nothing the
library sends may be made on the CPU by default; gloo takes either, which is why a CPU test suite cannot see such
a mistake (``tests/devicecheck.py`` can).  (Not ``torch.cuda.current_device()`` for good: that is ``cuda:0`` on
every rank that never called ``set_device``, and an NCCL group then pairs every rank's control tensor with GPU 0.)

**Means.**  Like DDP's default hook: the backend's own average where it has one (NCCL's ``ReduceOp.AVG``,
Horovod's ``Average``); otherwise fp16 and bf16 tensors are divided by the group size *before* the sum, so a sum
that would overflow does not, and other dtypes are summed, then divided.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

REDUCE_OPS = ("mean", "sum", "max")
HALF_DTYPES = (torch.float16, torch.bfloat16)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it, its group and its tag."""


@dataclasses.dataclass(frozen=True)
class Group:
    """A set of ranks that communicate together.

    ``name`` keys the meter (``"world"``, ``"g0-1"``...); ``handle`` is the backend's own object (a
    ``ProcessGroup``, a Horovod ``ProcessSet``); ``member``: whether the calling rank belongs to it; ``size``: how
    many ranks (a field, not a property: a sync reads it often)."""

    name: str
    ranks: Tuple[int, ...]
    handle: Any = dataclasses.field(default=None, compare=False, repr=False)
    member: bool = True
    size: int = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "size", len(self.ranks))


class Groups:
    """The groups a :class:`Comm` has made, by their ranks, the world among them.  Making a group is collective
    (every rank of the world makes it, in the same order) and each backend handle costs a communicator, so a
    group asked for again is the one made the first time.  ``rank``: the calling rank, for ``Group.member``."""

    def __init__(self, rank: int, size: int, world_handle: Any = None):
        self.rank, self.size = rank, size
        self.world = Group("world", tuple(range(size)), handle=world_handle)
        self.made: Dict[Tuple[int, ...], Group] = {self.world.ranks: self.world}

    def get(self, ranks: Iterable[int], name: Optional[str], make: Callable[[Tuple[int, ...]], Any]) -> Group:
        """The group of ``ranks`` (named ``name``, default ``g<first>-<last>``); ``make(ranks)`` gives the backend's
        handle for one not made yet."""
        ranks = tuple(sorted(int(r) for r in ranks))
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.size or len(set(ranks)) != len(ranks):
            raise ValueError(f"group ranks must be distinct ranks in [0, {self.size}), got {ranks}")
        if ranks not in self.made:
            self.made[ranks] = Group(name or f"g{ranks[0]}-{ranks[-1]}", ranks, make(ranks), member=self.rank in ranks)
        return self.made[ranks]


class Meter:
    """Payload bytes and call counts sent by this rank, per (group, kind, tag).

    ``kind`` is the collective (``"allreduce"``, ``"broadcast"``); ``tag`` is
    what the caller says the traffic is for (``"grad"``, ``"sync"``,
    ``"ab-grad"`` ...), so traffic per phase can be read back.  Bytes are the
    payload handed to the backend (numel x element size), the same on every
    member of the group; what the wire carries on top (ring factors,
    headers) is measured by the benchmark.
    """

    def __init__(self):
        self._bytes: Dict[Tuple[str, str, str], int] = defaultdict(int)
        self._calls: Dict[Tuple[str, str, str], int] = defaultdict(int)

    def record(self, group: str, kind: str, nbytes: int, tag: str = "") -> None:
        key = (group, kind, tag)
        self._bytes[key] += int(nbytes)
        self._calls[key] += 1

    def _total(self, table, group, kind, tag) -> int:
        return sum(
            v
            for (g, k, t), v in table.items()
            if (group is None or g == group) and (kind is None or k == kind) and (tag is None or t == tag)
        )

    def bytes(self, group: Optional[str] = None, kind: Optional[str] = None, tag: Optional[str] = None) -> int:
        """Total payload bytes, optionally filtered by group name, kind and tag."""
        return self._total(self._bytes, group, kind, tag)

    def calls(self, group: Optional[str] = None, kind: Optional[str] = None, tag: Optional[str] = None) -> int:
        """Number of collective calls, with the same filters as :meth:`bytes`."""
        return self._total(self._calls, group, kind, tag)

    def by_tag(self) -> Dict[str, int]:
        """Bytes per tag, e.g. ``{"sync": ..., "ab-grad": ...}``."""
        out: Dict[str, int] = defaultdict(int)
        for (_, _, t), v in self._bytes.items():
            out[t] += v
        return dict(out)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        """A JSON-friendly copy: ``{"group/kind/tag": {"bytes": .., "calls": ..}}``."""
        return {
            f"{g}/{k}/{t}": {"bytes": self._bytes[(g, k, t)], "calls": self._calls[(g, k, t)]}
            for (g, k, t) in sorted(self._bytes)
        }

    def load(self, snapshot: Dict[str, Dict[str, int]]) -> None:
        """Restore what :meth:`snapshot` gave (a resumed run then reports the bytes of the whole run)."""
        self.reset()
        for key, value in snapshot.items():
            g, k, t = key.split("/", 2)
            self._bytes[(g, k, t)] = int(value["bytes"])
            self._calls[(g, k, t)] = int(value["calls"])

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()

    def __repr__(self) -> str:
        return f"Meter(bytes={self.bytes()}, calls={self.calls()})"


class Work:
    """An in-flight collective.

    ``wait()`` blocks and returns the reduced tensors (already copied back
    into the caller's tensors).  ``future()`` gives a ``torch.futures.Future``
    of the same list, for DDP comm hooks; backends without native futures
    complete it at ``wait()``.
    """

    def __init__(self, wait: Callable[[], List[torch.Tensor]], future: Optional[torch.futures.Future] = None):
        self._wait = wait
        self._future = future
        self._result: Optional[List[torch.Tensor]] = None

    def wait(self) -> List[torch.Tensor]:
        if self._result is None:
            self._result = self._wait()
        return self._result

    def then(self, fn: Callable[[List[torch.Tensor]], List[torch.Tensor]]) -> "Work":
        """A Work whose result is ``fn(this work's result)``, run once when the reduction is done."""
        if self._future is not None:
            chained = self._future.then(lambda fut: fn(fut.value()))
            return Work(chained.wait, chained)
        return Work(lambda: fn(self.wait()))

    def future(self) -> torch.futures.Future:
        if self._future is None:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(self.wait())
            self._future = fut
        return self._future


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer holding ``tensors`` (no copy for a single contiguous tensor)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    flat = []
    for t in tensors:
        flat.append(t.reshape(-1))
    return torch.cat(flat)


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (skipped when ``flat`` is their own storage)."""
    if len(tensors) == 1 and tensors[0].is_contiguous() and flat.data_ptr() == tensors[0].data_ptr():
        return
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


class Call:
    """One collective of ``kind`` on ``group``, carrying ``flat`` for ``tag``; metered when it is made (unless
    ``metered`` is False: a verification, a broadcast's receiving end).

    A hung or failed collective is usually reported on every rank at once, from deep inside a backend; the
    description (kind, tag, bytes, group, ranks, this rank, how it is bounded in time) is what tells which of an
    algorithm's calls it was.  The rank and the bound are asked of ``comm`` only when the call fails: under torch
    the bound looks up the group's backend, and under torchft a retry on a smaller quorum may have changed the
    rank by then."""

    def __init__(self, comm: "Comm", kind: str, group: Group, tag: str, flat: torch.Tensor, metered: bool = True):
        self.comm, self.kind, self.group, self.tag = comm, kind, group, tag
        self.nbytes = flat.numel() * flat.element_size()
        if metered:
            comm.meter.record(group.name, kind, self.nbytes, tag)

    def describe(self) -> str:
        return (f"commhooks {self.kind} '{self.tag or 'untagged'}' of {self.nbytes} bytes on group {self.group.name} "
                f"(ranks {list(self.group.ranks)}), rank {self.comm.rank}{self.comm._timeout_words(self.group)}")

    def failed(self, exc: BaseException) -> CollectiveError:
        """The error to raise for what the backend raised: this call, named (and, where the backend says a peer
        closed its connection, that a peer left: the rank still here says so itself)."""
        left = any(words in str(exc) for words in ("Connection closed by peer", "Connection reset by peer"))
        why = (" (a peer left the job: its process ended, because it finished its data early or because it died, "
               "which its own log says; for uneven inputs wrap the loop in "
               "`with torch.distributed.algorithms.join.Join([ddp_model, state]):`)") if left else ""
        return CollectiveError(f"{self.describe()} failed{why}: {exc}")

    def guard(self, fn: Callable, *args, keep: tuple = ()):
        """``fn(*args)``; what it raises comes out as a :class:`CollectiveError` naming this call (the types in
        ``keep`` as they are, e.g. an error a wait already named)."""
        try:
            return fn(*args)
        except keep:
            raise
        except Exception as exc:
            raise self.failed(exc) from exc

    def complete(self, wait: Callable[[], None], future: Optional[torch.futures.Future],
                 finish: Callable[[], List[torch.Tensor]], async_op: bool):
        """``finish()`` once the started call is done: now, after ``wait()``, or else in a :class:`Work` (chained
        on the backend's ``future`` where it gives one, so a DDP hook's future completes with the backend's).
        A :class:`CollectiveError` from ``wait`` passes as it is (it says what failed already); any other error, or
        a future's, is named here."""

        def settled(done=None):
            if done is not None:
                self.guard(done.value)  # re-raises the backend's error
            return finish()

        def waited():
            self.guard(wait, keep=(CollectiveError,))
            return finish()

        if not async_op:
            return waited()
        if future is not None:
            chained = future.then(settled)
            return Work(lambda: chained.wait(), chained)
        return Work(waited)

    def pieces(self, started: Callable[[], torch.Tensor], numel: int, shape=None) -> Work:
        """A :class:`Work` giving what ``started()`` waits for (an allgather's or all-to-all's ``numel``-element
        pieces, concatenated) as one piece per member in group-rank order, viewed as ``shape`` if given; failures
        named."""

        def wait() -> List[torch.Tensor]:
            try:
                out = started()  # an allgather: as many pieces as members answered (a live quorum may shrink)
                out = list(out.chunk(out.numel() // numel if self.kind == "allgather" and numel else self.group.size))
                for i in range(len(out) if shape is not None else 0):
                    out[i] = out[i].view(shape)
                return out
            except Exception as exc:
                raise self.failed(exc) from exc

        return Work(wait)


class Reduction:
    """What an allreduce of ``op`` sends (:attr:`op`), and who divides a mean, the way DDP's default hook does:
    the backend's own average where it has one (``native()``), otherwise a sum, with fp16 and bf16 divided by the
    group size *before* it (done here, on ``flat``: the sum cannot overflow), other dtypes once after it."""

    def __init__(self, op: str, flat: torch.Tensor, size: int, native: Callable[[], bool]):
        self.op, self.size, self.divide_after = op, size, False
        if op == "mean" and not native():
            self.op = "sum"
            if flat.dtype in HALF_DTYPES:
                flat.div_(size)
            else:
                self.divide_after = True

    def finish(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        """``tensors``, holding the reduced ``flat`` (divided by the group size first if that was left to now)."""
        if self.divide_after:
            flat.div_(self.size)
        unflatten_into(flat, tensors)
        return tensors


class Comm:
    """Collectives over groups of ranks, with a byte meter.

    All calls reduce *in place* into the given tensors, like ``torch.distributed``.  ``group=None`` means the world.
    """

    fixed_world = True  # the same ranks for the whole run (False: a live quorum, which per-rank files cannot follow)

    def __init__(self, rank: int, size: int, timeout_s: Optional[float] = None,
                 device: Optional[torch.device] = None):
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s  # None: the backend's own default
        self.chosen_device: Optional[torch.device] = None if device is None else torch.device(device)
        self.meter = Meter()
        self.key: Optional[str] = None  # the key of allreduce calls without their own (keyed())
        self._groups = Groups(rank, size, self._world_handle())

    @property
    def world(self) -> Group:
        """Every rank of this Comm: what ``group=None`` means."""
        return self._groups.world

    @property
    def device(self) -> torch.device:
        """Where control tensors (barriers, agreements, step proofs) are made: the synced tensors' device, once a
        state sets it or the first tensors are handed to this Comm (the module docstring says why); before that,
        the backend's default."""
        return self.chosen_device if self.chosen_device is not None else self._default_device()

    @device.setter
    def device(self, value) -> None:
        self.chosen_device = None if value is None else torch.device(value)

    # ---- backend primitives -------------------------------------------------
    def _world_handle(self) -> Any:
        return None

    def _default_device(self) -> torch.device:
        """Where control tensors go before a state names its tensors' device."""
        return torch.device("cpu")

    def _native_mean(self, flat: torch.Tensor, group: Group) -> bool:
        """Whether the backend averages ``flat`` itself (``_allreduce_flat`` is then called with ``"mean"``)."""
        return False

    def _allreduce_flat(self, flat: torch.Tensor, op: str, group: Group, async_op: bool,
                        key: Optional[str] = None):
        """Reduce ``flat`` in place (``op``: ``"sum"``, ``"max"``, or ``"mean"`` where :meth:`_native_mean`);
        return ``(wait_fn, future_or_None)``."""
        raise NotImplementedError

    def _broadcast_flat(self, flat: torch.Tensor, src: int, group: Group) -> None:
        raise NotImplementedError

    def _allgather_flat(self, flat: torch.Tensor, group: Group) -> Callable[[], torch.Tensor]:
        """Start gathering every member's ``flat`` (same size everywhere); return a function that waits and
        gives them concatenated in group-rank order."""
        raise NotImplementedError

    def _alltoall_flat(self, flat: torch.Tensor, group: Group) -> Callable[[], torch.Tensor]:
        """Start an all-to-all of equal pieces: ``flat`` is ``group.size`` pieces, piece ``j`` for member ``j``;
        return a function that waits and gives the pieces received, concatenated in group-rank order."""
        raise NotImplementedError

    def _make_group(self, ranks: Tuple[int, ...]) -> Any:
        raise NotImplementedError

    # ---- public API -----------------------------------------------------------
    def keyed(self, key: str):
        """Inside, allreduce calls without a ``key`` of their own carry ``key``.  Adapters whose gradient hooks
        fire in an order that may differ between ranks (Horovod's per-parameter hooks) wrap each parameter's
        reduction in it, so a backend that pairs calls by name pairs them by parameter, whatever algorithm
        issues them."""
        return self._keyed(key)

    @contextlib.contextmanager
    def _keyed(self, key: str):
        previous, self.key = self.key, key
        try:
            yield
        finally:
            self.key = previous

    def new_group(self, ranks: Iterable[int], name: Optional[str] = None) -> Group:
        """Create (or return the cached) group of ``ranks``.  Collective: every rank of the world must call it, in
        the same order, even ranks outside the group (as ``torch.distributed.new_group``)."""
        return self._groups.get(ranks, name, self._make_group)

    def _timeout_words(self, group: Group) -> str:
        """How this collective is bounded in time, for error messages ("" if unbounded)."""
        return f" (timeout {self.timeout_s:g} s)" if self.timeout_s else ""

    def allreduce(self, tensors: Sequence[torch.Tensor], op: str = "mean", group: Optional[Group] = None,
                  async_op: bool = False, tag: str = "", metered: bool = True, key: Optional[str] = None):
        """Reduce a list of tensors in one flat call over ``group``.

        Returns the list (reduced in place), or a :class:`Work` if ``async_op``.  ``op`` is ``"mean"``, ``"sum"``
        or ``"max"``; all tensors must share dtype and device.  ``key``: a name for what is reduced that is the
        same on every rank whatever the order of the calls (e.g. the parameter names of a gradient; default: the
        one set by :meth:`keyed`); backends that pair calls by name (Horovod) use it.  ``metered=False`` keeps a
        verification call (a few bytes) out of the meter, which counts the algorithm's traffic.  A failure or
        timeout raises :class:`CollectiveError` naming the collective, its tag and group.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        key = self.key if key is None else key
        group = group or self.world
        tensors = list(tensors)
        if self.chosen_device is None and tensors:  # a Comm on its own: control tensors where these are
            self.chosen_device = tensors[0].device
        if not tensors or group.size == 1:  # nothing to send: the mean of one is itself, no copy
            return Work(lambda: tensors) if async_op else tensors
        flat = flatten(tensors)
        call = Call(self, "allreduce", group, tag, flat, metered)
        reduction = Reduction(op, flat, group.size, lambda: self._native_mean(flat, group))
        wait, fut = call.guard(self._allreduce_flat, flat, reduction.op, group, async_op, key)
        return call.complete(wait, fut, lambda: reduction.finish(flat, tensors), async_op)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0, group: Optional[Group] = None, tag: str = "",
                  metered: bool = True):
        """Broadcast ``tensors`` from global rank ``src`` to ``group``, in place; metered on ``src`` (unless
        ``metered`` is False: a repair outside training, which the meter, counting the algorithm's traffic, leaves
        out, so that every rank's report reads the same)."""
        group = group or self.world
        tensors = list(tensors)
        if self.chosen_device is None and tensors:
            self.chosen_device = tensors[0].device
        if not tensors or group.size == 1:
            return tensors
        flat = flatten(tensors)
        call = Call(self, "broadcast", group, tag, flat, metered and self.rank == src)
        call.guard(self._broadcast_flat, flat, src, group)
        unflatten_into(flat, tensors)
        return tensors

    def allgather(self, tensor: torch.Tensor, group: Optional[Group] = None, tag: str = "",
                  metered: bool = True, async_op: bool = False):
        """Every member's ``tensor`` (same shape and dtype everywhere), in group-rank order.

        For payloads a sum would break (int8 codes, packed bytes): each rank receives the others' and
        reduces them itself.  The meter counts this rank's own contribution, as for an allreduce.
        ``async_op``: a :class:`Work` whose ``wait()`` returns the list (the link works while you compute).
        """
        group = group or self.world
        if self.chosen_device is None:
            self.chosen_device = tensor.device
        if group.size == 1:
            return Work(lambda: [tensor]) if async_op else [tensor]
        return self._exchange("allgather", self._allgather_flat, tensor, group, tag, metered, async_op,
                              shape=tensor.shape)

    def alltoall(self, tensor: torch.Tensor, group: Optional[Group] = None, tag: str = "",
                 metered: bool = True, async_op: bool = False):
        """Member ``j`` gets piece ``j`` of every member's ``tensor`` (flat, ``group.size`` equal pieces, the same
        size everywhere): the list of pieces received, in group-rank order.

        The first half of a compressed mean that scales with the world (:mod:`commhooks.payload.exchange`).
        The meter counts the whole ``tensor`` (this rank's own piece included), as torch's payload counter
        counts ``all_to_all_single``.  ``async_op``: a :class:`Work` whose ``wait()`` returns the list.
        """
        group = group or self.world
        if self.chosen_device is None:
            self.chosen_device = tensor.device
        if tensor.numel() % group.size:
            raise ValueError(f"alltoall '{tag}': {tensor.numel()} elements do not split into {group.size} equal pieces")
        if group.size == 1:
            flat = tensor.reshape(-1)
            return Work(lambda: [flat]) if async_op else [flat]
        return self._exchange("alltoall", self._alltoall_flat, tensor, group, tag, metered, async_op)

    def _exchange(self, kind: str, primitive, tensor: torch.Tensor, group: Group, tag: str, metered: bool,
                  async_op: bool, shape=None):
        """An allgather or all-to-all of ``tensor`` (flat): meter it, start ``primitive``, and give the pieces it
        returns, one per member in group-rank order (viewed as ``shape`` if given); failures name the call."""
        flat = tensor.reshape(-1).contiguous()
        call = Call(self, kind, group, tag, flat, metered)
        work = call.pieces(call.guard(primitive, flat, group), flat.numel(), shape)
        return work if async_op else work.wait()

    def notify_join(self, joinable) -> None:
        """Tell a ``torch.distributed`` Join context that this rank still trains (no-op for other backends)."""

    def barrier(self, group: Optional[Group] = None) -> None:
        """Wait, on the host, for every rank of ``group``: an unmetered one-element allreduce on :attr:`device`
        (with the timeout), then its result read on the host.  The read matters under NCCL, where waiting on
        the work only orders the GPU stream and the host would go on before the others arrive; like
        ``torch.distributed.barrier``, this one holds the host.  One host read: for checkpoints and set-up,
        never a training step."""
        chosen = self.chosen_device
        flag = torch.zeros(1, device=self.device)
        self.allreduce([flag], op="sum", group=group, tag="barrier", metered=False)
        self.chosen_device = chosen  # a control tensor names no device for the synced tensors
        flag.tolist()
