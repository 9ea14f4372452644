"""The algorithm contract: what every commhooks algorithm is, and how the engines drive it.

An algorithm is a *state object* (a subclass of :class:`AlgorithmState`) plus
a config class (a subclass of :class:`~commhooks.config.HookConfig`),
registered once with :func:`commhooks.register_algorithm`.  The base class
owns everything algorithms share, so a subclass holds only its algorithm:

* the config, from a config object, a dict, a JSON path or keyword arguments;
* the :class:`~commhooks.comm.Comm` (default: ``torch.distributed``, over
  ``process_group``) and its byte meter;
* the start-up handshake: config, world size, parameter names and shapes,
  commhooks version and whatever :meth:`describe` adds must agree on every
  rank, or every rank raises the same ConfigError before training;
* an equal start: after :meth:`start` (groups) every rank holds rank 0's
  weights (:func:`~.parameters.start_equal`: broadcast where they differ,
  with a warning), then :meth:`begin` (set-up that reads them, such as a
  first basis);
* the optimizer step hooks that count steps and skipped steps;
* the post-sync check (``check_every``) and the sync counters;
* a run that ends synced (below) and torch's Joinable protocol;
* ``report()``, ``memory()``, the ``log_every`` line;
* ``state_dict`` / ``load_state_dict`` of the counters, ``remove``.

Two collaborators it owns do the rest: :class:`~.parameters.ParameterSet`
(``state.parameter_set``: the tensors covered, by name; parameters that join
later; strays the engine never hands over) and
:class:`~.step_alignment.StepAlignment` (``state.alignment``: the optimizer
step hooks, GradScaler takeover, the NaN/Inf guard, the step proof of each
sync and its check, the period agreement; the end-of-run warning).

The interface the engines drive (an engine adapter calls only these, and
chooses what to call from what the state *declares*, never from its name):

``begin_step()``
    Called by an optimizer step pre-hook, before every optimizer step, after
    the gradients are final (reduced, unscaled, clipped).  The base applies
    the NaN guard, then calls :meth:`before_step`.
``end_step()``
    Called by an optimizer step post-hook, after every optimizer step.  The
    base counts the step, then calls :meth:`after_step`: the place where a
    local method decides to :meth:`sync`, or a phase changes.
``reduce_bucket(grads, params, flat=None) -> Work``
    Only if the class declares ``reduces_gradients = True``.  Engines that
    hand gradients over (DDP's comm hook with its bucket, Horovod's
    per-parameter hooks, DeepSpeed at the accumulation boundary) call it
    once per bucket per optimizer step; it starts the reduction in place
    (the algorithm's :meth:`reduce_gradients`) and returns the in-flight
    :class:`~commhooks.comm.Work`.  A trainable parameter the engine never
    handed over in a step (a layer unfrozen after DDP built its buckets) is
    reduced by the state itself before the optimizer step, the same way.  A
    state that does not declare it gets no call, and its engine sends no
    gradient at all (local steps: DDP's hook hands the local bucket back).
``sync()``
    Average the model now.  Normally called by the state itself from
    :meth:`after_step`; public so a user can force one (e.g. before
    evaluation or a checkpoint).
``finish()`` (``with state:``), ``join_hook()``, ``end_join()``
    The end of a run (below).
``state_dict()`` / ``load_state_dict()``
    Everything needed to resume the schedule exactly, per rank.
``report()``
    A plain dict of what the algorithm did (for logs and users' loggers).

A run that ends synced.  A local method's ranks hold different models between
syncs (it declares ``runs_apart``), so a run that stops between two of them
(the data ran out, a loop ended early, one rank had fewer batches) would end
with different models, silently.  Four ways close the last round, all ending
in :meth:`final_sync` (which subclasses extend: land the syncs in flight
first): ``total_steps`` (the schedule ends its last period with a sync);
``with state:`` around the loop, or ``state.finish()`` after it; the end of a
``torch.distributed.algorithms.join.Join`` context with uneven inputs
(:meth:`end_join`; ranks out of data shadow the others' steps meanwhile,
:meth:`shadow_step`); frameworks' end-of-fit callbacks, which call
``finish()``.  A per-epoch ``with ddp_model.join():`` on even shards ends
with every rank stepping together: one flag allreduce, no sync.

Engine facts reach the state as an :class:`EngineFacts` (the unwrapped
module, whether the engine re-broadcasts buffers on every forward, ranks per
node from the launcher): adapters pass them; for a state built by hand the
base asks :func:`commhooks.facts.for_model` to derive them from
the model.  Algorithm code never reads an engine attribute or an environment
variable itself.

Writing a new algorithm: subclass, set ``reduces_gradients`` if it touches
gradients, implement :meth:`after_step` (and :meth:`before_step`,
:meth:`reduce_gradients`, :meth:`sync` as needed), keep extra resumable
state in :meth:`algorithm_state_dict`; then one registry line.  A sync made
with :meth:`average` carries the step proof (a few float32 elements of the
same call: ranks at different steps, or a NaN/Inf gradient on any rank under
``nonfinite="raise"``, raise on every rank; GradScaler scales that parted
are made equal); one made otherwise sends :meth:`step_proof` in its payload
and calls :meth:`check_proof` after (a few host reads: the sync's cost),
inside :meth:`collective_context`, then :meth:`synced`.  See the
documentation's design page ("Adding an algorithm").
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .. import comm as comms
from .._version import __version__
from ..comm import CollectiveError, Comm, Work
from ..facts import EngineFacts, for_model
from ..settings import HookConfig, to_dict
from .alignment import ShadowJoinHook
from .averaging import average_, float_buffers
from .consistency import verify_identical, verify_same_everywhere
from .parameters import ParameterSet, add_new_parameters, optimizer_list, reduce_strays, resolve_config, start_equal
from .parameters import tensors_to, unwrap_optimizer
from .step_alignment import StepAlignment, note_the_end, watch_the_end

log = logging.getLogger("commhooks")
_COLLECTIVE_HINT = ("if a peer has finished its data (uneven inputs), wrap the loop in "
          "`with torch.distributed.algorithms.join.Join([ddp_model, state]):`; if a peer died or is stuck, its own "
          "log says why")


class AlgorithmState:
    """Base class of every algorithm's state; the module docstring is the contract.

    ``optimizer``: the optimizer whose steps drive the schedule, or a list of them in the order the loop steps
    them (the first one's pre-hook starts an iteration, the last one's post-hook ends it; the parameters of all
    are synced).  ``model``: the (possibly wrapped) model; ``named_parameters`` replaces it where only those are
    at hand (Horovod).  ``engine``: facts from the adapter (default: derived from ``model``).  ``comm`` /
    ``process_group``: where the collectives go.  ``config=`` (object, dict, JSON path) or keyword settings, not
    both.  Built collectively: every rank constructs it at the same point (the handshake is a collective).
    """

    name: ClassVar[str] = ""  # set by register_algorithm
    config_class: ClassVar[type] = HookConfig  # set by register_algorithm
    reduces_gradients: bool = False  # declared (a class attribute, or a property of the settings): engines
    # hand gradients over only if True
    engine_data_parallel: ClassVar[bool] = False  # declared: the engine's own data parallelism (and sharding)
    # may run unchanged inside the groups of groups_needed (see data_parallel_groups)
    runs_apart: bool = False  # declared (a class attribute or a property): the ranks' models differ between
    # syncs, so a run must end with one (total_steps, `with state:`, finish())

    def __init__(self, optimizer: torch.optim.Optimizer, *, model: Optional[torch.nn.Module] = None,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 engine: Optional[EngineFacts] = None, process_group=None, comm: Optional[Comm] = None,
                 config=None, **settings):
        self.config = resolve_config(type(self), config, settings)
        self.optimizers = optimizer_list(optimizer)
        self.optimizer = self.optimizers[0]
        self.engine = engine if engine is not None else for_model(model)
        self.module = self.engine.module
        self.parameter_set = ParameterSet(self.module, self.optimizers, named_parameters, self.engine.master_slices)
        # every tensor handed to a collective is made where the synced tensors live (NCCL refuses CPU tensors)
        self.device = next((p.device for _, p in self.named_params), torch.device("cpu"))
        self.alignment = StepAlignment(self, [n for n, _ in self.named_params])  # step hooks, scaler, NaN guard
        self.validate()  # local checks first: a bad setting raises on every rank before any collective
        self.comm = comm if comm is not None else comms.TorchComm(process_group, timeout_s=self.config.timeout_s,
                                                                  device=self.device)
        self.comm.device = self.device
        self.step = self.syncs = self.skipped_steps = 0
        self.sync_steps: List[int] = []  # optimizer steps after which a sync happened (this process)
        self.joined = False  # True while this rank shadows the others inside a Join context
        self.join_ended_by_engine = False  # an engine's Join hook ran end_join already (DDP's, before its broadcast)
        self._join_config = None  # set by torch's Join context manager
        self._reduced: set = set()  # ids of the parameters the engine handed over this step (reduce_bucket)
        self._warned_end, self._end = False, None  # the end-of-run check (step_alignment.watch_the_end)
        self.setup()
        verify_same_everywhere(self.comm, f"the {self.display_name} hook", {
            "config": to_dict(self.config), "world": self.comm.size, "version": __version__,
            "params": [(n, tuple(p.shape)) for n, p in self.named_params], **self.describe()})
        self.start()
        start_equal(self)
        self.begin()
        self.parameter_set.warn_unoptimized(self.named_params, self.display_name)
        if not self.engine.drives_steps:
            self.alignment.hook(self.optimizers)
        if self.engine.attach is not None:
            self.engine.attach(self)

    @property
    def named_params(self) -> List[Tuple[str, torch.Tensor]]:
        """The tensors the state covers, by name (:class:`~.parameters.ParameterSet`)."""
        return self.parameter_set.named

    @property
    def display_name(self) -> str:
        """The class name without "State" (``QSR``, ``AB``), for messages."""
        name = type(self).__name__
        return name[:-5] if name.endswith("State") and len(name) > 5 else name

    @property
    def meter(self):
        """The byte meter of this state's :class:`Comm` (``meter.bytes()``, ``meter.by_tag()``)."""
        return self.comm.meter

    @classmethod
    def groups_needed(cls, config, world_size: int, local_world_size: Optional[int]) -> List[Tuple[int, ...]]:
        """The rank groups this algorithm will create for ``config`` (engines with static groups, such as
        Horovod's process sets, create them at start-up).  Local: no collective, no state."""
        return []

    @classmethod
    def data_parallel_groups(cls, config, world_size: int,
                             local_world_size: Optional[int]) -> Optional[List[Tuple[int, ...]]]:
        """The groups inside which the engine's own data parallelism (gradients averaged every step, optimizer
        state sharded) may run unchanged: those of :meth:`groups_needed` if ``engine_data_parallel``, else ``None``.
        An engine that can (DeepSpeed through ``mpu``) passes ``EngineFacts(replica_data_parallel=True)``."""
        return cls.groups_needed(config, world_size, local_world_size) if cls.engine_data_parallel else None

    # ------------------------------------------------------------ driven by engines
    def begin_step(self) -> None:
        """Before each iteration's first optimizer step: tell a Join context this rank trains; :meth:`before_step`."""
        if self._join_config is not None and self._join_config.enable:
            self.comm.notify_join(self)
        self.before_step()

    def end_step(self) -> None:
        """After each optimizer step: count it, then :meth:`after_step`; every ``log_every`` steps a log line."""
        self.step += 1
        watch_the_end(self)
        self.after_step()
        note_the_end(self)
        if self.config.log_every and self.step % self.config.log_every == 0 and self.comm.rank == 0:
            log.info(self.log_line())

    def reduce_bucket(self, grads: List[torch.Tensor], params: List[torch.Tensor],
                      flat: Optional[torch.Tensor] = None) -> Work:
        """What engines call with each bucket of gradients: :meth:`reduce_gradients`, noting the parameters."""
        self.parameter_set.refuse_sparse(grads, params, flat, self.display_name)
        self._reduced.update(map(id, params))
        return self.reduce_gradients(grads, params, flat)

    def not_a_training_step(self) -> None:
        """The next ``optimizer.step()`` is no training step (Horovod's ``broadcast_optimizer_state`` stepping on
        zero gradients): neither counted nor checked, nothing sent; the schedule counts training steps only."""
        self.alignment.uncounted = True

    def optimizer_pre_step(self, optimizer) -> None:
        """What the optimizer pre-hook does (GradScaler, NaN guard, strays, :meth:`begin_step`), for frameworks
        that drive the steps themselves (``EngineFacts(drives_steps=True)``) and know when the gradients are final
        (Lightning's ``on_before_optimizer_step``, after the closure's backward)."""
        self.alignment.pre_step(unwrap_optimizer(optimizer), unwrap_optimizer(optimizer) is self.optimizers[0])

    def optimizer_post_step(self, optimizer) -> None:
        """The counterpart of :meth:`optimizer_pre_step`, after the update (counts the step past the last
        optimizer of the iteration)."""
        if unwrap_optimizer(optimizer) is self.optimizers[-1]:
            self.alignment.post_step()

    def state_dict(self) -> dict:
        """The counters and :meth:`algorithm_state_dict` (tensors and plain types only).  Refused (NonFiniteError)
        after a NaN/Inf gradient under ``nonfinite="raise"``: the weights may hold it."""
        if self.nonfinite_seen():
            self.alignment.raise_nonfinite(1, f"checkpoint at step {self.step}")
        return {"step": self.step, "syncs": self.syncs, "skipped_steps": self.skipped_steps,
                "config": to_dict(self.config), "meter": self.meter.snapshot(), **self.algorithm_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`, its tensors moved to the synced tensors' device first (a checkpoint is read
        onto the CPU, and may come from another device)."""
        state = tensors_to(state, self.device)
        self.alignment.guard.clear()  # the weights loaded are those the checkpoint held, written only when finite
        self.step, self.syncs = int(state["step"]), int(state.get("syncs", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if "meter" in state:  # the bytes of the whole run, not only of the part since the resume
            self.meter.load(state["meter"])
        self.load_algorithm_state_dict(state)

    def remove(self) -> None:
        """Unregister the optimizer hooks and hand AMP scaling back (a DDP comm hook stays until DDP is rebuilt)."""
        self.alignment.release()

    # ------------------------------------------------------------ subclass hooks (defaults: nothing)
    def validate(self) -> None:
        """Check the settings against the model, before the Comm exists (raise ConfigError)."""
    def setup(self) -> None:
        """Set-up before the handshake (``self.comm`` exists; no collective here)."""
    def start(self) -> None:
        """Collective set-up after the handshake (groups)."""
    def begin(self) -> None:
        """Collective set-up that reads the weights, once every rank starts from the same ones (AB's bases)."""
    def before_step(self) -> None:
        """Runs before each optimizer step (e.g. choose a period from the lr it will use)."""
    def after_step(self) -> None:
        """Runs after each optimizer step (``self.step`` already counts it): sync, or change phase."""
    def parameters_added(self, new: List[Tuple[str, torch.Tensor]]) -> None:
        """Parameters that joined the sync (after :meth:`refresh_parameters`)."""
    def load_algorithm_state_dict(self, state: dict) -> None:
        """Restore what :meth:`algorithm_state_dict` saved."""

    def sync(self) -> None:
        """Average the model over the world now (subclasses define what that means)."""
        raise NotImplementedError

    def reduce_gradients(self, grads: List[torch.Tensor], params: List[torch.Tensor],
                         flat: Optional[torch.Tensor] = None) -> Work:
        """Start reducing one bucket of gradients in place (only states with ``reduces_gradients``)."""
        raise NotImplementedError(f"{type(self).__name__} does not reduce gradients (reduces_gradients=False)")

    def describe(self) -> Dict[str, object]:
        """More facts every rank must agree on (JSON-able), checked in the handshake."""
        return {}

    def start_group(self):
        """The group whose ranks must start from the same synced tensors (``None``: the world; a state whose
        engine shards inside replica groups names the group of this rank's shard across them)."""
        return None

    def sync_named(self) -> List[Tuple[str, torch.Tensor]]:
        """Everything a sync makes identical, by name; subclasses extend it."""
        return list(self.named_params) + [(f"buffer{i}", b) for i, b in enumerate(self.float_buffers())]

    def identical_named(self) -> List[Tuple[str, torch.Tensor]]:
        """What ``check_every`` compares: :meth:`sync_named`, unless a subclass's syncs land later."""
        return self.sync_named()

    def algorithm_state_dict(self) -> dict:
        """The algorithm's own resumable state."""
        return {}

    def algorithm_report(self) -> dict:
        """The algorithm's own figures for :meth:`report`."""
        return {}

    def algorithm_memory(self) -> Dict[str, int]:
        """The bytes the algorithm keeps, by kind."""
        return {}

    def status(self) -> str:
        """The algorithm's state in a few words, for the ``log_every`` line."""
        return ""

    def wrap_scheduler(self, scheduler):
        """The lr scheduler to step in place of ``scheduler`` (an algorithm may shape the lr around its phase
        switches, e.g. AB's LR rebound); default: ``scheduler`` itself."""
        return scheduler

    # ------------------------------------------------------------ offered to algorithms
    def lr(self) -> float:
        """The lr a sync rule reads: the first param group's ``scheduled_lr`` (set by an lr wrapper such as
        :class:`~commhooks.algorithms.ab.LRRebound`) or else its ``lr``."""
        group = self.optimizer.param_groups[0]
        return float(group.get("scheduled_lr", group["lr"]))

    def float_buffers(self) -> List[torch.Tensor]:
        """The module's floating buffers (BatchNorm statistics), unless the engine re-broadcasts them."""
        return [] if self.engine.buffers_synced_each_forward else float_buffers(self.module)

    def average(self, tensors: Sequence[torch.Tensor], group=None, tag: str = "sync") -> None:
        """Average ``tensors`` in place over ``group`` (default: the world), the step proof riding along."""
        proof = self.step_proof()
        with self.collective_context():
            average_(self.comm, tensors, group=group, tag=tag, rider=proof)
        self.check_proof(proof, group, tag)

    def step_proof(self) -> torch.Tensor:
        """This rank's step proof, on the synced tensors' device, to ride in a sync's payload."""
        return self.alignment.proof()

    def check_proof(self, mean: torch.Tensor, group, tag: str, step: Optional[int] = None) -> None:
        """After a sync: check the ranks' mean proof (made at ``step``, default now); raises on every rank."""
        self.alignment.check(mean, group, tag, step)

    @contextlib.contextmanager
    def collective_context(self):
        """A failed or timed-out sync collective names the step and the usual causes."""
        try:
            yield
        except CollectiveError as exc:
            # the message already holds the backend's
            raise CollectiveError(f"{exc} [at optimizer step {self.step}; {_COLLECTIVE_HINT}]") from None

    def rounding_seed(self) -> int:
        """A seed for this rank's stochastic rounding at this step: a function of the rank and the step only, so a
        resumed run rounds as the uninterrupted one did."""
        return (self.step * 1_000_003 + self.comm.rank) % (2 ** 61)

    def agree_on_period(self, local: Optional[int]) -> Optional[int]:
        """The period every rank uses: the max over ranks inside a Join (a joined rank sends 0) or under the
        engine's ``lr_may_differ``; otherwise ``local``, no communication."""
        return self.alignment.agree_on_period(local)

    def synced(self, group=None) -> None:
        """Count a completed sync, let the engine refresh; every ``check_every``-th, prove ``group`` agrees."""
        self.tensors_changed()
        self.syncs += 1
        self.sync_steps.append(self.step)
        note_the_end(self)
        if self.config.check_every and self.syncs % self.config.check_every == 0:
            verify_identical(self.comm, self.identical_named(),
                             f"after {self.display_name} sync {self.syncs} (step {self.step})", group=group)

    def tensors_changed(self) -> None:
        """Tell the engine the synced tensors changed outside an optimizer step (after a sync, a re-basis)."""
        if self.engine.tensors_changed is not None:
            self.engine.tensors_changed()

    def refresh_parameters(self) -> List[str]:
        """Bring in parameters that became trainable or joined an optimizer since; returns their names."""
        return add_new_parameters(self)

    # ------------------------------------------------------------ the run's end, torch's Joinable protocol
    def __enter__(self):
        """``with state:`` around the training loop: its exit ends the run synced (:meth:`finish`)."""
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:  # after an error the other ranks may not come: no collective then
            self.finish()
        return False

    def finish(self) -> None:
        """End the run with the same model on every rank: land the syncs in flight and, unless the last step
        synced, sync now.  Collective: every rank calls it after its last step (``with state:`` does)."""
        self.final_sync()
        note_the_end(self)

    def final_sync(self) -> None:
        """Sync if the last round was left open (the end of a run: ``finish()``, a Join with uneven inputs)."""
        self.joined = False
        if self.step and self.in_sync_at() != self.step:
            self.sync()

    def in_sync_at(self) -> Optional[int]:
        """The optimizer step right after which every rank last held the same weights (a complete sync; ``None``
        before the first).  Checkpoints marked ``synced`` and the end of a Join rely on it."""
        return self.sync_steps[-1] if self.sync_steps else None

    def join_hook(self, **kwargs) -> ShadowJoinHook:
        """torch's Joinable protocol: ``with Join([ddp_model, state]):`` (ranks with fewer batches shadow)."""
        return ShadowJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.comm.world.handle

    def shadow_step(self) -> None:
        """One iteration of the others, on a rank that has run out of data: agree on periods, count the step,
        take part in its sync or phase switch (and in the reduction of the strays, with zeros); no update."""
        self.joined = True
        if self.reduces_gradients:
            reduce_strays(self, shadow=True)
        self.before_step()
        self.end_step()

    def end_join(self) -> None:
        """At the end of a Join context (every rank): sync the open round if some rank ran out of data early."""
        flag = torch.tensor([1.0 if self.joined else 0.0], device=self.device)
        if self.comm.size > 1:
            self.comm.allreduce([flag], op="max", tag="join", metered=False)
        self.joined = False
        if flag.item():
            self.final_sync()
        note_the_end(self)

    # ------------------------------------------------------------ what it tells its user
    def report(self) -> dict:
        """What the algorithm did, as a plain dict for logs and your own logger (W&B, TensorBoard): steps, syncs,
        bytes sent (total and per tag), what plain allreduce would have sent, memory kept, :meth:`algorithm_report`."""
        return _report(self)

    def memory(self) -> Dict[str, int]:
        """Bytes of device memory the algorithm keeps beyond the model and its optimizer, by kind (anchor, outer
        momentum, residual, sync buffers, syncs in flight, AB bases ...) and ``total``.  Size runs by it: each fp32
        copy of the synced tensors costs 4 bytes per element."""
        return _memory(self)

    def log_line(self) -> str:
        """The ``log_every`` line: step, the algorithm's :meth:`status`, syncs, bytes against plain allreduce."""
        return _log_line(self)

    def format_report(self) -> str:
        """:meth:`report` as lines for a log."""
        return _format_report(type(self).__name__, self.report())

    @property
    def allreduce_bytes_per_step(self) -> int:
        """What plain data parallelism sends per rank per step (one fp32 allreduce of the trainable parameters)."""
        return self.parameter_set.allreduce_bytes()

    def nonfinite_seen(self) -> bool:
        """Whether this rank saw a NaN/Inf gradient under ``nonfinite="raise"`` (host read)."""
        return self.alignment.guard.seen() is not None

    def refuse_nonfinite_everywhere(self, where: str) -> None:
        """NonFiniteError on every rank if any rank saw a NaN/Inf gradient under ``nonfinite="raise"`` (one flag
        allreduce, a host read): before an engine's own collective checkpoint, where one rank refusing alone would
        leave the others waiting."""
        self.alignment.refuse_everywhere(where)

    def use_scaler(self, scaler) -> None:
        """Keep ``scaler``'s scale (a ``torch.amp.GradScaler``) equal on every rank: at a sync where the ranks'
        scales differ, all take the smallest (one 8-byte allreduce, only then)."""
        self.alignment.scaler = scaler

    @property
    def scaler(self):
        """Deprecated: ``state.alignment.scaler`` (set by :meth:`use_scaler`)."""
        warnings.warn("state.scaler is deprecated: read state.alignment.scaler", DeprecationWarning, stacklevel=2)
        return self.alignment.scaler

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step={self.step}, syncs={self.syncs})"


# ------------------------------------------------------------ what a state tells its user


def _report(state: AlgorithmState) -> dict:
    """:meth:`AlgorithmState.report`: steps, syncs, bytes sent (total and per tag), what plain allreduce would have
    sent, memory kept, plus the algorithm's own figures."""
    sent, dense = state.meter.bytes(), state.step * state.allreduce_bytes_per_step
    kept = state.memory()
    weights = sum(p.numel() * p.element_size() for _, p in state.named_params)
    return {"algorithm": state.name, "step": state.step, "syncs": state.syncs, "skipped_steps": state.skipped_steps,
            "bytes": sent, "bytes_by_tag": state.meter.by_tag(), "allreduce_bytes": dense,
            "bytes_vs_allreduce": round(sent / dense, 4) if dense else None,
            "memory_bytes": kept, "memory_vs_weights": round(kept["total"] / weights, 3) if weights else None,
            **state.algorithm_report()}


def _memory(state: AlgorithmState) -> Dict[str, int]:
    """:meth:`AlgorithmState.memory`: the algorithm's kinds (anchor, outer momentum, residual, sync buffers, syncs
    in flight, AB bases ...), the NaN guard's record, and their ``total``."""
    kinds = dict(state.algorithm_memory())
    first = state.alignment.guard.first
    if first is not None:
        kinds["nonfinite_guard"] = first.numel() * 8
    kinds["total"] = sum(kinds.values())
    return kinds


def _log_line(state: AlgorithmState) -> str:
    """:meth:`AlgorithmState.log_line`."""
    sent, dense = state.meter.bytes(), state.step * state.allreduce_bytes_per_step
    share = f" ({sent / dense:.1%})" if dense else ""
    status = state.status()
    return (f"{state.display_name} step {state.step}{' | ' + status if status else ''} | syncs {state.syncs} | "
            f"sent {size(sent)}{share} of plain allreduce's {size(dense)}")


def _format_report(name: str, r: dict) -> str:
    """A :meth:`AlgorithmState.report` as lines for a log."""
    head = f"{name} report: step {r['step']}, syncs {r['syncs']}, {size(r['bytes'])} sent"
    rest = [f"  {k}: {v}" for k, v in r.items() if k not in ("algorithm", "step", "syncs", "bytes", "bytes_by_tag")]
    tags = "  bytes by tag: " + ", ".join(f"{t}={size(b)}" for t, b in sorted(r["bytes_by_tag"].items()))
    return "\n".join([head, *rest, tags])


def size(nbytes: float) -> str:
    """Bytes in a unit that shows them: ``1.64 kB``, ``19.28 MB`` (a small model's sends are not ``0.00 MB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
