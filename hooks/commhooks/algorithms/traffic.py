"""Traffic declarations: what one rank sends, per optimizer step and per sync, stated by its algorithm.

Every algorithm registers, beside its config and state classes, a function

    traffic(config, setting: Setting) -> Traffic

that says, for a validated config and a :class:`Setting` (the parameter shapes, the world and its nodes, the rank,
the run's length and lr), which collectives the rank calls at each optimizer step and with how many bytes: exactly
what its :class:`~commhooks.comm.Meter` will count (payload handed to the backend; the step proof inside each sync;
unmetered checks left out). That one statement serves the meter tests (measured against declared), the planner
(``commhooks plan``, which adds a link model) and the docs.

Scopes say which ranks a collective spans, which is what the planner needs to know about the links it crosses:

* ``world``: every rank;
* ``group``: the ranks of one replica group (the ranks of a node), over the node's own links;
* ``across``: one rank of each replica group (the same part of the model), ``g`` such collectives side by side,
  each crossing the nodes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .contract.steps import STEP_PROOF_BYTES

Shapes = Sequence[Tuple[str, Tuple[int, ...]]]
KINDS = ("allreduce", "allgather", "alltoall", "broadcast")
SCOPES = ("world", "group", "across")


@dataclasses.dataclass(frozen=True)
class Send:
    """One collective call of this rank: its kind, the bytes the meter counts for it, its tag and scope;
    ``behind``: the optimizer steps it runs behind before anything waits for it (an overlapped sync: sent after
    step ``s``, landing after step ``s + behind``; 0: the step waits for it)."""

    kind: str
    nbytes: int
    tag: str
    scope: str = "world"
    behind: int = 0

    def __post_init__(self):
        if self.kind not in KINDS or self.scope not in SCOPES:
            raise ValueError(f"Send(kind={self.kind!r}, scope={self.scope!r}): kind in {KINDS}, scope in {SCOPES}")


def constant_lr(step: int) -> float:
    return 1.0


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a declaration needs besides the config.

    ``shapes``: the trainable parameters (name, shape), in the model's order.  ``lr(step)``: the lr of the
    optimizer step after ``step`` done (QSR's periods, AB x QSR's phases).  ``buffers``: floating buffer
    elements (BatchNorm statistics); ``moments``: optimizer moment elements (``average_optimizer_state``: 2 per
    parameter for Adam, 1 for SGD with momentum).  ``element_bytes``: of the parameters and gradients.
    ``proof_bytes``: the step proof every sync carries (older recorded runs: 36).  ``engine_data_parallel``: an
    engine averages inside each replica group itself and hands over its shard: an equal run of the concatenated
    parameters (DeepSpeed ZeRO), or with ``shard_rows`` each parameter's chunk of rows (FSDP2's ``Shard(0)``).
    ``outer_optimizer`` (QSR): a torch optimizer takes the outer step (``QSRState(outer_optimizer=...)``, Python
    only; a sync is then an outer step whatever the config).  ``factor_ranks`` (AB): the rank of each compressed
    layer (None: kept dense), one mapping for every AB phase or a list, one per phase; AB's ranks come from the
    data, so without them AB declares a bound. ``same_start``: every rank starts from the same weights (DDP
    broadcasts them; runs recorded before 2026-12-05 averaged them anyway: False)."""

    shapes: Tuple[Tuple[str, Tuple[int, ...]], ...]
    world: int = 2
    local_world: Optional[int] = None
    rank: int = 0
    steps: int = 1200
    lr: Callable[[int], float] = constant_lr
    buffers: int = 0
    moments: int = 0
    element_bytes: int = 4
    proof_bytes: int = STEP_PROOF_BYTES
    engine_data_parallel: bool = False
    shard_rows: bool = False
    outer_optimizer: bool = False
    factor_ranks: Optional[object] = None
    same_start: bool = True

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.shapes)

    @classmethod
    def of(cls, shapes: Shapes, **kw) -> "Setting":
        return cls(shapes=tuple((n, tuple(s)) for n, s in shapes), **kw)


@dataclasses.dataclass
class Traffic:
    """What one rank sends over a run of ``len(timeline)`` optimizer steps.

    ``timeline[s - 1]``: the calls made during optimizer step ``s`` (its gradient reductions and whatever its
    post-hook runs: a sync, a phase switch); ``before``: those made before the first step (building the state).
    ``step``: the calls of a typical step between syncs; ``sync``: those of one complete sync (both for the
    docs).  ``sync_steps``: the steps a sync completed at. ``exact``: False when the bytes are a bound (``note``
    says which).  ``group``: the ranks of this rank's replica group (scope ``group``); a planner takes them for
    a node's ranks unless they are more."""

    timeline: List[Tuple[Send, ...]]
    step: Tuple[Send, ...] = ()
    sync: Tuple[Send, ...] = ()
    sync_steps: List[int] = dataclasses.field(default_factory=list)
    exact: bool = True
    note: str = ""
    before: Tuple[Send, ...] = ()
    group: int = 1

    @property
    def steps(self) -> int:
        return len(self.timeline)

    def sends(self, kind: Optional[str] = None, tag: Optional[str] = None, scope: Optional[str] = None):
        """Every call of the run matching the filters."""
        for calls in [self.before, *self.timeline]:
            for c in calls:
                if (kind is None or c.kind == kind) and (tag is None or c.tag == tag) and (
                        scope is None or c.scope == scope):
                    yield c

    def bytes(self, kind: Optional[str] = None, tag: Optional[str] = None, scope: Optional[str] = None) -> int:
        """Bytes over the run (what ``meter.bytes(kind=, tag=)`` reads at its end)."""
        return sum(c.nbytes for c in self.sends(kind, tag, scope))

    def calls(self, kind: Optional[str] = None, tag: Optional[str] = None, scope: Optional[str] = None) -> int:
        return sum(1 for _ in self.sends(kind, tag, scope))

    def by_tag(self, upto: Optional[int] = None) -> Dict[str, int]:
        """Bytes per tag over the run, or over its first ``upto`` steps (``meter.by_tag()`` then)."""
        out: Dict[str, int] = defaultdict(int)
        for calls in [self.before, *self.timeline[:upto]]:
            for c in calls:
                out[c.tag] += c.nbytes
        return dict(out)

    def at(self, step: int) -> Dict[str, int]:
        """Bytes per tag during optimizer step ``step`` (1-based)."""
        out: Dict[str, int] = defaultdict(int)
        for c in self.timeline[step - 1]:
            out[c.tag] += c.nbytes
        return dict(out)

    def bytes_at(self, step: int) -> int:
        return sum(c.nbytes for c in self.timeline[step - 1])

    @property
    def syncs(self) -> int:
        return len(self.sync_steps)


def body_sends(codec, numel: int, proof_bytes: int, tag: str, scope: str, size: int) -> Tuple[List[Send], List[Send]]:
    """A sync payload of ``numel`` elements in ``codec`` (:class:`~commhooks.payload.Codec`) with the
    step proof, averaged over ``size`` ranks: ``(the calls when it is sent, the calls when it lands)``.  fp32:
    one allreduce; otherwise one allgather of the packed bytes, or the two-step exchange
    (:mod:`~commhooks.payload.exchange`): an all-to-all of the pieces when sent, an allgather of the owners'
    encoded means when it lands."""
    if codec.name == "fp32":
        return [Send("allreduce", proof_bytes + 4 * numel, tag, scope)], []
    two_step = codec.exchange_for(size)
    if two_step is None:
        return [Send("allgather", proof_bytes + codec.nbytes(numel), tag, scope)], []
    first, second = two_step.nbytes(numel, proof_bytes)
    return [Send("alltoall", first, tag, scope)], [Send("allgather", second, tag, scope)]


def averaged(numel: int, setting: Setting, tag: str, scope: str) -> List[Send]:
    """:meth:`AlgorithmState.average` of ``numel`` elements with the step proof riding in the float32 call (a
    call of its own when the tensors are not float32)."""
    if setting.element_bytes == 4:
        return [Send("allreduce", setting.proof_bytes + 4 * numel, tag, scope)]
    return [Send("allreduce", setting.element_bytes * numel, tag, scope),
            Send("allreduce", setting.proof_bytes, tag, scope)]


def describe(traffic: Traffic) -> str:
    """One line per kind of call of a step and of a sync, for the docs and ``commhooks plan --config``."""
    def line(calls):
        return "; ".join(f"{c.kind} {c.nbytes:,} B ({c.tag}, {c.scope})" for c in calls) or "nothing"
    return f"a step: {line(traffic.step)}\na sync: {line(traffic.sync)}"
