"""The collective interface every algorithm talks to, and its byte meter.

Algorithms in commhooks never call ``torch.distributed`` or Horovod directly:
they call a :class:`Comm`.  That keeps them backend-agnostic (the same code
runs under DDP, Horovod and DeepSpeed) and lets one place count the traffic.

A backend implements a few primitives on a single contiguous tensor
(``_allreduce_flat``, ``_broadcast_flat``, ``_allgather_flat``, ``_alltoall_flat``,
``_make_group``); this base class coalesces lists of tensors into one flat
buffer (one call on the wire, as DDP's buckets do), takes the mean the way
DDP does, and records every call in the :class:`Meter`.

**Device.**  ``Comm.device`` is where the library makes the tensors it hands
to a collective of its own (handshakes, step proofs, agreements, checksums):
the device of the tensors the algorithm syncs (the state sets it when it is
built).  An NCCL-only process group (``init_process_group("nccl")``, as in
PyTorch's DDP tutorial) refuses CPU tensors, so nothing the library sends may
be made on the CPU by default; gloo takes either, which is why a CPU test
suite cannot see such a mistake (``tests/devicecheck.py`` can).

**Means.**  Like DDP's default hook: the backend's own average where it has
one (NCCL's ``ReduceOp.AVG``, Horovod's ``Average``); otherwise fp16 and bf16
tensors are divided by the group size *before* the sum, so a sum that would
overflow does not, and fp32 tensors are summed, then divided.
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

    ``name`` keys the meter (``"world"``, ``"g0-1"``...); ``handle`` is the
    backend's own object (a ``ProcessGroup``, a Horovod ``ProcessSet``).
    ``member`` says whether the calling rank belongs to it.
    """

    name: str
    ranks: Tuple[int, ...]
    handle: Any = dataclasses.field(default=None, compare=False, repr=False)
    member: bool = True

    @property
    def size(self) -> int:
        return len(self.ranks)


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
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (skipped when ``flat`` is their own storage)."""
    if len(tensors) == 1 and tensors[0].is_contiguous() and flat.data_ptr() == tensors[0].data_ptr():
        return
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


class Comm:
    """Collectives over groups of ranks, with a byte meter.

    All calls reduce *in place* into the given tensors, like
    ``torch.distributed``.  ``group=None`` means the world.
    """

    fixed_world = True  # the same ranks for the whole run (False: a live quorum, which per-rank files cannot follow)

    def __init__(self, rank: int, size: int, timeout_s: Optional[float] = None,
                 device: Optional[torch.device] = None):
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s  # None: the backend's own default
        self._device: Optional[torch.device] = None if device is None else torch.device(device)
        self.meter = Meter()
        self._key: Optional[str] = None  # see keyed()
        self.world = Group("world", tuple(range(size)), handle=self._world_handle())
        self._groups: Dict[Tuple[int, ...], Group] = {self.world.ranks: self.world}

    @property
    def device(self) -> torch.device:
        """Where control tensors (barriers, agreements, step proofs) are made: the synced tensors' device.

        A state sets it to its parameters' device.  A Comm used on its own takes the device of the first tensors
        it is handed; before that, the backend's default.  (Not ``torch.cuda.current_device()`` for good: that
        is ``cuda:0`` on every rank that never called ``set_device``, and an NCCL group then pairs every rank's
        control tensor with GPU 0.)"""
        return self._device if self._device is not None else self._default_device()

    @device.setter
    def device(self, value) -> None:
        self._device = None if value is None else torch.device(value)

    def _adopt_device(self, tensors: Sequence[torch.Tensor]) -> None:
        if self._device is None and tensors:
            self._device = tensors[0].device

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
    @contextlib.contextmanager
    def keyed(self, key: str):
        """Inside, allreduce calls without a ``key`` of their own carry ``key``.  Adapters whose gradient hooks
        fire in an order that may differ between ranks (Horovod's per-parameter hooks) wrap each parameter's
        reduction in it, so a backend that pairs calls by name pairs them by parameter, whatever algorithm
        issues them."""
        previous, self._key = self._key, key
        try:
            yield
        finally:
            self._key = previous

    def new_group(self, ranks: Iterable[int], name: Optional[str] = None) -> Group:
        """Create (or return the cached) group of ``ranks``.

        Collective: every rank of the world must call it, in the same order,
        even ranks outside the group (as ``torch.distributed.new_group``).
        """
        ranks = tuple(sorted(int(r) for r in ranks))
        if not ranks or ranks[0] < 0 or ranks[-1] >= self.size or len(set(ranks)) != len(ranks):
            raise ValueError(f"group ranks must be distinct ranks in [0, {self.size}), got {ranks}")
        if ranks in self._groups:
            return self._groups[ranks]
        handle = self._make_group(ranks)
        group = Group(name or f"g{ranks[0]}-{ranks[-1]}", ranks, handle, member=self.rank in ranks)
        self._groups[ranks] = group
        return group

    def _timeout_words(self, group: Group) -> str:
        """How this collective is bounded in time, for error messages ("" if unbounded)."""
        return f" (timeout {self.timeout_s:g} s)" if self.timeout_s else ""

    def _describe(self, kind: str, group: Group, tag: str, nbytes: int) -> str:
        limit = self._timeout_words(group)
        return (f"commhooks {kind} '{tag or 'untagged'}' of {nbytes} bytes on group {group.name} "
                f"(ranks {list(group.ranks)}), rank {self.rank}{limit}")

    def allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        op: str = "mean",
        group: Optional[Group] = None,
        async_op: bool = False,
        tag: str = "",
        metered: bool = True,
        key: Optional[str] = None,
    ):
        """Reduce a list of tensors in one flat call over ``group``.

        Returns the list (reduced in place), or a :class:`Work` if
        ``async_op``.  ``op`` is ``"mean"``, ``"sum"`` or ``"max"``; all
        tensors must share dtype and device.  ``key``: a name for what is
        reduced that is the same on every rank whatever the order of the calls
        (e.g. the parameter names of a gradient; default: the one set by
        :meth:`keyed`); backends that pair calls by name (Horovod) use it.
        ``metered=False`` keeps a
        verification call (a few bytes) out of the meter, which counts the
        algorithm's traffic.  A failure or timeout raises
        :class:`CollectiveError` naming the collective, its tag and group.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"op must be one of {REDUCE_OPS}, got {op!r}")
        key = self._key if key is None else key
        group = group or self.world
        tensors = list(tensors)
        self._adopt_device(tensors)
        if not tensors or group.size == 1:  # nothing to send: the mean of one is itself, no copy
            return Work(lambda: tensors) if async_op else tensors
        flat = flatten(tensors)
        nbytes = flat.numel() * flat.element_size()
        what = lambda: self._describe("allreduce", group, tag, nbytes)  # noqa: E731
        if metered:
            self.meter.record(group.name, "allreduce", nbytes, tag)
        wire_op, divide_after = op, False
        if op == "mean" and not self._native_mean(flat, group):
            wire_op = "sum"
            if flat.dtype in HALF_DTYPES:  # divide first, as DDP's default hook does: the sum cannot overflow
                flat.div_(group.size)
            else:
                divide_after = True
        try:
            wait, fut = self._allreduce_flat(flat, wire_op, group, async_op, key)
        except Exception as exc:
            raise CollectiveError(f"{what()} failed: {exc}") from exc

        def finish(done=None):
            if done is not None:
                try:
                    done.value()  # re-raises the backend's error
                except Exception as exc:
                    raise CollectiveError(f"{what()} failed: {exc}") from exc
            if divide_after:
                flat.div_(group.size)
            unflatten_into(flat, tensors)
            return tensors

        def wait_and_finish():
            try:
                wait()
            except CollectiveError:
                raise
            except Exception as exc:
                raise CollectiveError(f"{what()} failed: {exc}") from exc
            return finish()

        if not async_op:
            return wait_and_finish()
        if fut is not None:
            chained = fut.then(finish)
            return Work(lambda: chained.wait(), chained)
        return Work(wait_and_finish)

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0, group: Optional[Group] = None, tag: str = ""):
        """Broadcast ``tensors`` from global rank ``src`` to ``group``, in place."""
        group = group or self.world
        tensors = list(tensors)
        self._adopt_device(tensors)
        if not tensors or group.size == 1:
            return tensors
        flat = flatten(tensors)
        nbytes = flat.numel() * flat.element_size()
        if self.rank == src:
            self.meter.record(group.name, "broadcast", nbytes, tag)
        try:
            self._broadcast_flat(flat, src, group)
        except Exception as exc:
            raise CollectiveError(f"{self._describe('broadcast', group, tag, nbytes)} failed: {exc}") from exc
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
        self._adopt_device([tensor])
        if group.size == 1:
            return Work(lambda: [tensor]) if async_op else [tensor]
        return self._exchange("allgather", self._allgather_flat, tensor, group, tag, metered, async_op,
                              shape=tensor.shape)

    def alltoall(self, tensor: torch.Tensor, group: Optional[Group] = None, tag: str = "",
                 metered: bool = True, async_op: bool = False):
        """Member ``j`` gets piece ``j`` of every member's ``tensor`` (flat, ``group.size`` equal pieces, the same
        size everywhere): the list of pieces received, in group-rank order.

        The first half of a compressed mean that scales with the world (:mod:`commhooks.algorithms.exchange`).
        The meter counts the whole ``tensor`` (this rank's own piece included), as torch's payload counter
        counts ``all_to_all_single``.  ``async_op``: a :class:`Work` whose ``wait()`` returns the list.
        """
        group = group or self.world
        self._adopt_device([tensor])
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
        nbytes = flat.numel() * flat.element_size()
        what = lambda: self._describe(kind, group, tag, nbytes)  # noqa: E731
        if metered:
            self.meter.record(group.name, kind, nbytes, tag)
        try:
            started = primitive(flat, group)
        except Exception as exc:
            raise CollectiveError(f"{what()} failed: {exc}") from exc

        def wait() -> List[torch.Tensor]:
            try:
                out = started()  # an allgather: as many pieces as members answered (a live quorum may shrink)
                pieces = out.chunk(out.numel() // flat.numel() if kind == "allgather" and flat.numel() else group.size)
                return [p.view(shape) for p in pieces] if shape is not None else list(pieces)
            except Exception as exc:
                raise CollectiveError(f"{what()} failed: {exc}") from exc

        work = Work(wait)
        return work if async_op else work.wait()

    def notify_join(self, joinable) -> None:
        """Tell a ``torch.distributed`` Join context that this rank still trains (no-op for other backends)."""

    def barrier(self, group: Optional[Group] = None) -> None:
        """Wait, on the host, for every rank of ``group``: an unmetered one-element allreduce on :attr:`device`
        (with the timeout), then its result read on the host.  The read matters under NCCL, where waiting on
        the work only orders the GPU stream and the host would go on before the others arrive; like
        ``torch.distributed.barrier``, this one holds the host.  One host read: for checkpoints and set-up,
        never a training step."""
        chosen = self._device
        flag = torch.zeros(1, device=self.device)
        self.allreduce([flag], op="sum", group=group, tag="barrier", metered=False)
        self._device = chosen  # a control tensor names no device for the synced tensors
        flag.tolist()
