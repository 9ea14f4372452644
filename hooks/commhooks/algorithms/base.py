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
  weights (broadcast where they differ, with a warning), then :meth:`begin`
  (set-up that reads them, such as a first basis);
* the optimizer step hooks that count steps and skipped steps;
* the post-sync check (``check_every``) and the sync counters;
* ``state_dict`` / ``load_state_dict`` of the counters, ``remove``.

Small collaborators it owns do the rest: :class:`~.parameters.ParameterSet`
(``state.parameter_set``: the tensors covered, by name; parameters that join
later; strays the engine never hands over), :class:`~.step_alignment.StepAlignment`
(``state.alignment``: GradScaler takeover, the NaN/Inf guard, the step proof of
each sync and its check, the period agreement).  Two parts it inherits, each
in its own module: :class:`~.run_end.RunEnd` (a run that ends synced:
``with state:``, ``finish()``, torch's Joinable protocol; with the warnings
of an open end) and :class:`~.reporting.Reporting` (``report``, ``memory``,
the ``log_every`` line).

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
    reduced by the state itself before the optimizer step, the same way.  A state that does
    not declare it gets no call, and its engine sends no gradient at all
    (local steps: DDP's hook hands the local bucket back).
``sync()``
    Average the model now.  Normally called by the state itself from
    :meth:`after_step`; public so a user can force one (e.g. before
    evaluation or a checkpoint).
``state_dict()`` / ``load_state_dict()``
    Everything needed to resume the schedule exactly, per rank.
``report()``
    A plain dict of what the algorithm did (for logs and users' loggers).

Engine facts reach the state as an :class:`EngineFacts` (the unwrapped
module, whether the engine re-broadcasts buffers on every forward, ranks per
node from the launcher): adapters pass them; for a state built by hand the
base asks :mod:`commhooks.facts` (imported at the call) to derive them from
the model.  Algorithm code never reads an engine attribute or an environment
variable itself.

Writing a new algorithm: subclass, set ``reduces_gradients`` if it touches
gradients, implement :meth:`after_step` (and :meth:`before_step`,
:meth:`reduce_gradients`, :meth:`sync` as needed), keep extra resumable
state in :meth:`algorithm_state_dict`; then one registry line.  See the
documentation's design page ("Adding an algorithm").
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .._version import __version__
from ..comm import CollectiveError, Comm, Work
from ..config import ConfigError, HookConfig, to_dict
from . import run_end
from .averaging import average_, float_buffers
from .consistency import same_everywhere, verify_identical, verify_same_everywhere
from .engine_facts import EngineFacts, _facts_of_hand_built_state
from .parameters import ParameterSet, optimizer_list, reduce_strays, resolve_config, tensors_to, unwrap_optimizer
from .parameters import user_stacklevel
from .reporting import Reporting
from .run_end import RunEnd
from .step_alignment import StepAlignment


log = logging.getLogger("commhooks")


class AlgorithmState(RunEnd, Reporting):
    """Base class of every algorithm's state; see the module docstring for the contract.

    ``optimizer``: the optimizer whose steps drive the schedule, or a list
    of them in the order the loop steps them (the first one's pre-hook
    starts an iteration, the last one's post-hook ends it; the parameters
    of all are synced).  ``model``:
    the (possibly wrapped) model; ``named_parameters`` replaces it where only
    those are at hand (Horovod).  ``engine``: facts from the adapter
    (default: derived from ``model``).  ``comm`` / ``process_group``: where
    the collectives go.  ``config=`` (object, dict, JSON path) or keyword
    settings, not both.  Built collectively: every rank constructs it at the
    same point (the handshake is a collective).
    """

    name: ClassVar[str] = ""  # set by register_algorithm
    config_class: ClassVar[type] = HookConfig  # set by register_algorithm
    reduces_gradients: bool = False  # declared (a class attribute, or a property of the settings): engines
    # hand gradients over only if True
    engine_data_parallel: ClassVar[bool] = False  # declared: the engine's own data parallelism (and sharding)
    # may run unchanged inside the groups of groups_needed (see data_parallel_groups)
    runs_apart: bool = False  # declared (a class attribute or a property): the ranks' models differ between
    # syncs, so a run must end with one (total_steps, `with state:`, finish())

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: Optional[torch.nn.Module] = None,
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
        engine: Optional[EngineFacts] = None,
        process_group=None,
        comm: Optional[Comm] = None,
        config=None,
        **settings,
    ):
        self.config = resolve_config(type(self), config, settings)
        self.optimizers = optimizer_list(optimizer)
        self.optimizer = self.optimizers[0]
        self.engine = engine if engine is not None else _facts_of_hand_built_state(model)
        self.module = self.engine.module
        self.parameter_set = ParameterSet(self.module, self.optimizers, named_parameters, self.engine.master_slices)
        # where the synced tensors live: every tensor the state hands to a collective is made there (an
        # NCCL-only process group refuses CPU tensors)
        self.device = next((p.device for _, p in self.named_params), torch.device("cpu"))
        self.alignment = StepAlignment(self, [n for n, _ in self.named_params])  # scaler, NaN guard, step proofs
        self.validate()  # local checks first: a bad setting raises on every rank before any collective
        if comm is None:
            from ..comm.torch_dist import TorchComm

            comm = TorchComm(process_group, timeout_s=self.config.timeout_s, device=self.device)
        comm.device = self.device
        self.comm = comm
        self.step = 0
        self.syncs = 0
        self.skipped_steps = 0
        self.sync_steps: List[int] = []  # optimizer steps after which a sync happened (this process)
        self.joined = False  # True while this rank shadows the others inside a Join context
        self.join_ended_by_engine = False  # an engine's Join hook ran end_join already (DDP's, before its broadcast)
        self._join_config = None  # set by torch's Join context manager
        self._in_context = False  # inside `with state:`, whose exit ends the run synced
        self._uncounted = False  # the next optimizer step is no training step (see not_a_training_step)
        self._reduced: set = set()  # ids of the parameters the engine handed over this step (reduce_bucket)
        self._warned_end = False
        self._end = None  # what the end-of-run check reads (run_end.watch_the_end)
        self.setup()
        verify_same_everywhere(comm, f"the {self.display_name} hook", {
            "config": to_dict(self.config), "world": comm.size, "version": __version__,
            "params": [(n, tuple(p.shape)) for n, p in self.named_params], **self.describe()})
        self.start()
        self._start_equal()
        self.begin()
        run_end.warn_unoptimized(self, self.named_params)
        self._handles = []
        if not self.engine.drives_steps:
            self._register_step_hooks()
        if self.engine.attach is not None:
            self.engine.attach(self)

    def _register_step_hooks(self) -> None:
        self.alignment.take_over_amp(self.optimizers)
        first, last = self.optimizers[0], self.optimizers[-1]
        for opt in self.optimizers:
            self._handles.append(opt.register_step_pre_hook(
                lambda o, args, kwargs: self._pre_step(o, starts=o is first)))
            if opt is last:
                self._handles.append(opt.register_step_post_hook(lambda o, args, kwargs: self._post_step()))

    def _post_step(self) -> None:
        if self._uncounted:
            self._uncounted = False
            return
        self.end_step()

    @property
    def named_params(self) -> List[Tuple[str, torch.Tensor]]:
        """The tensors the state covers, by name (:class:`~.parameters.ParameterSet`)."""
        return self.parameter_set.named

    @property
    def _name_of(self) -> Dict[int, str]:
        return self.parameter_set.name_of

    @property
    def _guard(self):
        """The NaN/Inf guard (:class:`~.consistency.NonfiniteGuard`), owned by :attr:`alignment`."""
        return self.alignment.guard

    @property
    def scaler(self):
        """The GradScaler whose scale the syncs keep equal (:meth:`use_scaler`)."""
        return self.alignment.scaler

    # ------------------------------------------------------------ set-up
    @classmethod
    def groups_needed(cls, config, world_size: int, local_world_size: Optional[int]) -> List[Tuple[int, ...]]:
        """The rank groups this algorithm will create for ``config`` (engines with static groups, such as
        Horovod's process sets, create them at start-up).  Local: no collective, no state."""
        return []

    @classmethod
    def data_parallel_groups(cls, config, world_size: int,
                             local_world_size: Optional[int]) -> Optional[List[Tuple[int, ...]]]:
        """The groups inside which the engine's own data parallelism may run unchanged (gradients averaged
        every step, optimizer state sharded), or ``None`` if the algorithm reduces gradients itself.

        An engine that can restrict its data parallelism to a group (DeepSpeed through ``mpu``) does so and
        builds the state with ``EngineFacts(replica_data_parallel=True)``.  Local: no collective.
        Declared by ``engine_data_parallel = True``; the groups are those of :meth:`groups_needed`."""
        return cls.groups_needed(config, world_size, local_world_size) if cls.engine_data_parallel else None

    def validate(self) -> None:
        """Subclass hook: check the settings against the model, before the Comm exists (raise ConfigError)."""

    def setup(self) -> None:
        """Subclass hook: set-up before the handshake (``self.comm`` exists; no collective here)."""

    def describe(self) -> Dict[str, object]:
        """Subclass hook: more facts every rank must agree on (JSON-able), checked in the handshake."""
        return {}

    def start(self) -> None:
        """Subclass hook: collective set-up after the handshake (groups, a first basis)."""

    def begin(self) -> None:
        """Subclass hook: collective set-up that reads the weights, once every rank starts from the same ones
        (AB's first phase: its bases)."""

    def start_group(self):
        """Subclass hook: the group whose ranks must start from the same synced tensors (``None``: the world;
        a state whose engine shards inside replica groups names the group of this rank's shard across them)."""
        return None

    def _start_equal(self) -> None:
        """Every rank starts from the first rank's weights, as DDP's constructor and Horovod's
        ``broadcast_parameters`` make them.  An engine may leave them different (DeepSpeed with replica groups
        broadcasts inside each group only; a script that seeds no model), and a local method would then
        average the different starts at its first sync.  One 32-byte fingerprint comparison per group at
        set-up (a host read); only where the starts differ, a broadcast from the group's first rank, and a
        warning on every rank."""
        if self.comm.size == 1:
            return
        params = [p for _, p in self.named_params]
        buffers = self.float_buffers()
        group = self.start_group()
        checks = [(params + buffers, None)] if group is None else [(params, group), (buffers, None)]
        fixed = []
        for tensors, over in checks:
            if not tensors or same_everywhere(self.comm, tensors, group=over):
                continue
            src = (over or self.comm.world).ranks[0]
            for dtype in dict.fromkeys(t.dtype for t in tensors):
                self.comm.broadcast([t.data for t in tensors if t.dtype == dtype], src=src, group=over, tag="start")
            fixed.append("the synced tensors" if over is None else "the shards")
        if group is not None:  # shard groups decide apart: the engine's refresh (a collective) runs on all or none
            anywhere = torch.tensor([1.0 if fixed else 0.0], device=self.device)
            self.comm.allreduce([anywhere], op="max", tag="start", metered=False)
            if anywhere.tolist()[0] and not fixed:
                fixed.append("another group's shards")
        if fixed:
            self.tensors_changed()
            warnings.warn(
                f"{self.display_name}: the ranks started from different weights ({' and '.join(fixed)} differed); "
                "every rank now starts from the first rank's, as DDP's constructor and Horovod's "
                "broadcast_parameters do (seed the model the same on every rank, torch.manual_seed, to start there "
                "yourself)", stacklevel=user_stacklevel())

    @property
    def display_name(self) -> str:
        """The class name without "State" (``QSR``, ``AB``), for messages."""
        name = type(self).__name__
        return name[:-5] if name.endswith("State") and len(name) > 5 else name

    @property
    def meter(self):
        """The byte meter of this state's :class:`Comm` (``meter.bytes()``, ``meter.by_tag()``)."""
        return self.comm.meter

    def lr(self) -> float:
        """The lr a sync rule should read: the schedule's value (``scheduled_lr`` of an lr wrapper such as
        :class:`~commhooks.algorithms.ab.LRRebound` if present, else ``lr``) of the first param group."""
        group = self.optimizer.param_groups[0]
        return float(group.get("scheduled_lr", group["lr"]))

    # ----------------------------------------------------- driven by engines
    def not_a_training_step(self) -> None:
        """The next ``optimizer.step()`` is no training step (an engine's state initialisation, e.g. Horovod's
        ``broadcast_optimizer_state`` stepping on zero gradients): it is neither counted nor checked, and nothing
        is sent.  Adapters call it; the schedule stays a function of the training steps."""
        self._uncounted = True

    def _pre_step(self, optimizer, starts: bool) -> None:
        """Pre-hook of every optimizer: a GradScaler's unscale/skip, the NaN guard; the first one also
        starts the iteration (:meth:`begin_step`)."""
        if self._uncounted:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        dropped, checked = self.alignment.scaler_step(optimizer, params)  # a GradScaler checked these: it decides
        if starts and self.reduces_gradients:
            if dropped:  # no update this step (every rank's overflow check agrees after the engine's reduction)
                self._reduced = set()
            else:
                self._reduce_strays()
        if not checked and self.alignment.guard_step(params):
            dropped = True
        if dropped:
            self.skipped_steps += 1
        if starts:
            self.begin_step()

    def optimizer_pre_step(self, optimizer) -> None:
        """For frameworks that drive the steps themselves (``EngineFacts(drives_steps=True)``) and know when this
        step's gradients are final (Lightning's ``on_before_optimizer_step``, after the closure's backward):
        what the optimizer pre-hook does otherwise (GradScaler, NaN guard, strays, :meth:`begin_step`)."""
        self._pre_step(unwrap_optimizer(optimizer), starts=unwrap_optimizer(optimizer) is self.optimizers[0])

    def optimizer_post_step(self, optimizer) -> None:
        """The counterpart of :meth:`optimizer_pre_step`, after the update (counts the step past the last
        optimizer of the iteration)."""
        if unwrap_optimizer(optimizer) is self.optimizers[-1]:
            self._post_step()

    def reduce_bucket(self, grads: List[torch.Tensor], params: List[torch.Tensor],
                      flat: Optional[torch.Tensor] = None) -> Work:
        """What engines call with each bucket of gradients: :meth:`reduce_gradients`, noting which parameters
        the engine handed over this step."""
        if flat is not None and flat.layout != torch.strided:  # DDP hands a sparse gradient over as the buffer
            sparse = [self._name_of.get(id(p), "?") for p in params]
        else:
            sparse = [self._name_of.get(id(p), "?") for g, p in zip(grads, params) if g.layout != torch.strided]
        if sparse:
            raise ConfigError(
                f"{self.display_name} averages gradients here and {', '.join(sparse)} has a sparse one "
                "(nn.Embedding(sparse=True)?), which it cannot send. Build the layer with sparse=False; QSR without "
                "replica groups sends no gradients and takes sparse ones")
        self._reduced.update(map(id, params))
        return self.reduce_gradients(grads, params, flat)

    def _reduce_strays(self, shadow: bool = False) -> None:
        """Reduce the gradients of trainable parameters the engine did not hand over this step
        (:func:`~.parameters.reduce_strays`; ``shadow``: a joined rank's part, zeros)."""
        reduce_strays(self, shadow)

    def begin_step(self) -> None:
        """Before each iteration's first optimizer step: tell a Join context this rank is still training,
        then :meth:`before_step`."""
        if self._join_config is not None and self._join_config.enable:
            self.comm.notify_join(self)
        self.before_step()

    def end_step(self) -> None:
        """After each optimizer step: count it, then :meth:`after_step`; every ``log_every`` steps a log line."""
        self.step += 1
        if not self._warned_end:
            run_end.watch_the_end(self)
        self.after_step()
        run_end.note_the_end(self)
        if self.config.log_every and self.step % self.config.log_every == 0 and self.comm.rank == 0:
            log.info(self.log_line())

    def before_step(self) -> None:
        """Subclass hook: runs before each optimizer step (e.g. choose a period from the lr it will use)."""

    def after_step(self) -> None:
        """Subclass hook: runs after each optimizer step (``self.step`` already counts it)."""

    def reduce_gradients(self, grads: List[torch.Tensor], params: List[torch.Tensor],
                         flat: Optional[torch.Tensor] = None) -> Work:
        """Start reducing one bucket of gradients in place (only states with ``reduces_gradients``)."""
        raise NotImplementedError(f"{type(self).__name__} does not reduce gradients (reduces_gradients=False)")

    def sync(self) -> None:
        """Average the model over the world now (subclasses define what that means)."""
        raise NotImplementedError

    # ------------------------------------------------------ shared helpers
    def float_buffers(self) -> List[torch.Tensor]:
        """The module's floating buffers (BatchNorm statistics), unless the engine re-broadcasts them."""
        return [] if self.engine.buffers_synced_each_forward else float_buffers(self.module)

    def average(self, tensors: Sequence[torch.Tensor], group=None, tag: str = "sync") -> None:
        """Average ``tensors`` in place over ``group`` (default: the world), one flat call per dtype.

        The step counter rides along (:func:`alignment.step_proof`, a few float32 elements of the same
        call): ranks at different steps raise DivergenceError on every rank.  A failed or timed-out
        collective says which step it was and what usually causes it.
        """
        proof = self.step_proof()
        with self.collective_context():
            average_(self.comm, tensors, group=group, tag=tag, rider=proof)
        self.check_proof(proof, group, tag)

    def rounding_seed(self) -> int:
        """A seed for this rank's stochastic rounding at this step: a function of the rank and the step only, so a
        resumed run rounds as the uninterrupted one did."""
        return (self.step * 1_000_003 + self.comm.rank) % (2 ** 61)

    def step_proof(self) -> torch.Tensor:
        """This rank's step proof (GradScaler scale, NaN/Inf record), on the synced tensors' device, to ride in a
        sync's payload."""
        return self.alignment.proof()

    def check_proof(self, mean: torch.Tensor, group, tag: str, step: Optional[int] = None) -> None:
        """After a sync: the ranks' mean proof shows the same step everywhere (else DivergenceError on every
        rank) and no NaN/Inf gradient on any rank (else NonFiniteError on every rank); equalize GradScaler
        scales that parted.  ``step``: the step the proof was made at (default: now; a sync applied later was
        sent earlier).  A few host reads: the sync's cost, stated in the docs (GPUs and NCCL)."""
        self.alignment.check(mean, group, tag, step)

    def refuse_nonfinite_everywhere(self, where: str) -> None:
        """Raise NonFiniteError on every rank if any rank saw a NaN/Inf gradient under ``nonfinite="raise"``
        (one flag allreduce and a host read): before an engine's own collective checkpoint, where one rank
        refusing alone would leave the others waiting."""
        self.alignment.refuse_everywhere(where)

    def nonfinite_seen(self) -> bool:
        """Whether this rank saw a NaN/Inf gradient under ``nonfinite="raise"`` (host read)."""
        return self._guard.seen() is not None

    @contextlib.contextmanager
    def collective_context(self):
        """A failed or timed-out sync collective names the step and the usual causes."""
        try:
            yield
        except CollectiveError as exc:
            raise CollectiveError(
                f"{exc} [at optimizer step {self.step}; if a peer has finished its data (uneven inputs), wrap the "
                "loop in `with torch.distributed.algorithms.join.Join([ddp_model, state]):`; if a peer died or "
                "is stuck, its own log says why]") from None  # the message already holds the backend's

    def use_scaler(self, scaler) -> None:
        """Keep ``scaler``'s scale (a ``torch.amp.GradScaler``) equal on every rank: at a sync where the
        ranks' scales differ, all take the smallest (one 8-byte allreduce, only then)."""
        self.alignment.scaler = scaler

    def agree_on_period(self, local: Optional[int]) -> Optional[int]:
        """The period every rank uses: the max over ranks, inside a Join context (a joined rank, whose lr no
        longer moves, sends 0) or when the engine may leave some ranks' lr behind (``lr_may_differ``).
        Otherwise ``local`` unchanged, no communication."""
        return self.alignment.agree_on_period(local)

    def sync_named(self) -> List[Tuple[str, torch.Tensor]]:
        """Everything a sync makes identical, by name (what ``check_every`` compares); subclasses extend it."""
        return list(self.named_params) + [(f"buffer{i}", b) for i, b in enumerate(self.float_buffers())]

    def synced(self, group=None) -> None:
        """Count a completed sync and let the engine refresh what derives from the synced tensors; every
        ``check_every``-th, prove the ranks of ``group`` (default: the world) now agree (raises on every rank)."""
        self.tensors_changed()
        self.syncs += 1
        self.sync_steps.append(self.step)
        run_end.note_the_end(self)
        if self.config.check_every and self.syncs % self.config.check_every == 0:
            verify_identical(self.comm, self.identical_named(),
                             f"after {self.display_name} sync {self.syncs} (step {self.step})", group=group)

    def identical_named(self) -> List[Tuple[str, torch.Tensor]]:
        """What a sync makes identical on every rank, checked by ``check_every``: :meth:`sync_named` unless a
        subclass's syncs land later (then, e.g., the anchors they average into)."""
        return self.sync_named()

    def tensors_changed(self) -> None:
        """Tell the engine the synced tensors changed outside an optimizer step (after a sync, a re-basis)."""
        if self.engine.tensors_changed is not None:
            self.engine.tensors_changed()

    def refresh_parameters(self) -> List[str]:
        """Bring in parameters that became trainable or were added to an optimizer since the state was built.

        Called before each sync (local check; a handshake only when something changed, and then on every
        rank that made the same change, as ranks running the same code do).  Returns the new names.
        """
        new = self.parameter_set.new()
        if not new:
            return []
        verify_same_everywhere(self.comm, f"the {self.display_name} hook's new parameters",
                               {"new": [(n, tuple(p.shape)) for n, p in new], "step": self.step})
        self.parameter_set.add(new)
        self._guard.extend([n for n, _ in new])
        run_end.warn_unoptimized(self, new)
        self.parameters_added(new)
        return [n for n, _ in new]

    def parameters_added(self, new: List[Tuple[str, torch.Tensor]]) -> None:
        """Subclass hook: parameters that joined the sync (after :meth:`refresh_parameters`)."""

    # ---------------------------------------------------------- lifecycle
    def remove(self) -> None:
        """Unregister the optimizer hooks and hand AMP scaling back (a DDP comm hook stays until DDP is rebuilt)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.alignment.release_amp()

    def state_dict(self) -> dict:
        """The counters and the subclass's :meth:`algorithm_state_dict` (tensors and plain types only).  Refused
        (NonFiniteError) after a NaN/Inf gradient under ``nonfinite="raise"``: the weights may hold it."""
        if self.nonfinite_seen():
            self.alignment.raise_nonfinite(1, f"checkpoint at step {self.step}")
        return {"step": self.step, "syncs": self.syncs, "skipped_steps": self.skipped_steps,
                "config": to_dict(self.config), "meter": self.meter.snapshot(), **self.algorithm_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; every tensor in it lands on the synced tensors' device first (a checkpoint
        is read onto the CPU, and may come from another device)."""
        state = tensors_to(state, self.device)
        self._guard.clear()  # the weights loaded are those the checkpoint held, written only when finite
        self.step = int(state["step"])
        self.syncs = int(state.get("syncs", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if "meter" in state:  # the bytes of the whole run, not only of the part since the resume
            self.meter.load(state["meter"])
        self.load_algorithm_state_dict(state)

    def algorithm_state_dict(self) -> dict:
        """Subclass hook: the algorithm's own resumable state."""
        return {}

    def load_algorithm_state_dict(self, state: dict) -> None:
        """Subclass hook: restore what :meth:`algorithm_state_dict` saved."""

    def wrap_scheduler(self, scheduler):
        """The lr scheduler to step in place of ``scheduler`` (an algorithm may shape the lr around its
        phase switches, e.g. AB's LR rebound); default: ``scheduler`` itself."""
        return scheduler

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step={self.step}, syncs={self.syncs})"
