"""The algorithm contract: what every commhooks algorithm is, and how the engines drive it.

An algorithm is a *state object* (a subclass of :class:`AlgorithmState`, overriding the hooks of
:class:`AlgorithmHooks`) plus a config class (a subclass of :class:`~commhooks.settings.HookConfig`), registered
once with :func:`commhooks.register_algorithm`.  The base owns what algorithms share, so a subclass holds only its
algorithm: the config (an object, a dict, a JSON path or keyword arguments); the :class:`~commhooks.comm.Comm`
(default: ``torch.distributed`` over ``process_group``) and its byte meter; the start-up handshake (config, world
size, parameter names and shapes, version and :meth:`~AlgorithmHooks.describe` agree on every rank, or every rank
raises the same ConfigError before training); an equal start (:func:`~.parameters.start_equal`, between
:meth:`~AlgorithmHooks.start` and :meth:`~AlgorithmHooks.begin`, at construction or, where the script sets the
weights after it, where the first step begins: :meth:`~AlgorithmState.start_training`); a run that ends synced;
``state_dict``.  Its collaborators: ``state.parameter_set`` (:class:`~.parameters.ParameterSet`, the tensors covered),
``state.alignment`` (:class:`~.steps.StepAlignment`, the optimizer step hooks) and ``state.sync_context``
(:class:`~.steps.SyncContext`, the counters and what else a sync needs: the algorithm hands it to its sync code).

The interface the engines drive (an adapter calls only these, and chooses what to call from what the state
*declares*, never from its name): ``begin_step()`` / ``end_step()`` (the optimizer step hooks call them, or an
engine that drives the steps: they run :meth:`~AlgorithmHooks.before_step` and, the step counted,
:meth:`~AlgorithmHooks.after_step`, where a local method decides to sync); ``reduce_bucket(grads, params, flat)``,
only if the class declares ``reduces_gradients`` (DDP's buckets, Horovod's per-parameter hooks, DeepSpeed at the
accumulation boundary; a state that does not declare it gets no call, and its engine sends no gradient at all);
``sync()``, ``finish()`` (``with state:``), ``join_hook()``; ``state_dict()`` / ``load_state_dict()``,
``report()``.  Engine facts reach the state as an :class:`~commhooks.facts.EngineFacts` (adapters pass them; for a
state built by hand, :func:`commhooks.facts.for_model`): algorithm code never reads an engine attribute or an
environment variable itself.
"""

from __future__ import annotations

import logging
import sys
import warnings
import weakref
from typing import ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ... import comm as comms
from ..._version import __version__
from ...comm import Comm, Work
from ...facts import EngineFacts, for_model
from ...settings import HookConfig, to_dict
from ..averaging import average_, float_buffers
from .amp import AmpScaling
from .checks import verify_same_everywhere
from .deprecated import DeprecatedNames
from .join import Joinable
from .report import Reporting
from .parameters import ParameterSet, optimizer_list, resolve_config, start_equal, tensors_to, unwrap_optimizer
from .steps import NonfiniteGuard, StepAlignment, SyncContext

log = logging.getLogger("commhooks")


class AlgorithmHooks:
    """What an algorithm declares and overrides, with the defaults; :class:`AlgorithmState` calls them.

    Writing one: subclass :class:`AlgorithmState`, declare ``reduces_gradients`` if it touches gradients,
    implement :meth:`after_step` (and :meth:`before_step`, :meth:`reduce_gradients`, :meth:`sync` as needed),
    keep resumable state in :meth:`algorithm_state_dict`; then one registry line (the design page, "Adding an
    algorithm").  A sync made with :meth:`~AlgorithmState.average` carries the step proof (ranks at different
    steps, or a NaN/Inf gradient anywhere, raise on every rank); one made otherwise hands its sync code
    ``self.sync_context`` (:class:`~.steps.SyncContext`), which sends ``proof()`` in its payload and calls
    ``check()`` after, inside ``failures()``, then ``synced()``."""

    name: ClassVar[str] = ""  # set by register_algorithm
    config_class: ClassVar[type] = HookConfig  # set by register_algorithm
    reduces_gradients: bool = False  # (or a property of the settings) engines hand gradients over only if True
    engine_data_parallel: ClassVar[bool] = False  # the engine's own data parallelism (and sharding) may run
    # unchanged inside the groups of groups_needed (see data_parallel_groups)
    runs_apart: bool = False  # (or a property) the ranks' models differ between syncs, so a run must end with one

    @classmethod
    def groups_needed(cls, config, world_size: int, local_world_size: Optional[int]) -> List[Tuple[int, ...]]:
        """The rank groups this algorithm will create for ``config`` (engines with static groups, such as
        Horovod's process sets, create them at start-up).  Local: no collective, no state."""
        return []

    @classmethod
    def data_parallel_groups(cls, config, world_size: int,
                             local_world_size: Optional[int]) -> Optional[List[Tuple[int, ...]]]:
        """The groups inside which the engine's own data parallelism (gradients averaged every step, optimizer
        state sharded) may run unchanged: those of :meth:`groups_needed` if ``engine_data_parallel``, else
        ``None``. An engine that can (DeepSpeed through ``mpu``) passes
        ``EngineFacts(replica_data_parallel=True)``."""
        return cls.groups_needed(config, world_size, local_world_size) if cls.engine_data_parallel else None

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
    def copied_from_peer(self) -> None:
        """Loaded from another replica's state (live recovery): drop what was that replica's own (residuals)."""

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


class AlgorithmState(AlgorithmHooks, Joinable, Reporting, DeprecatedNames):
    """Base class of every algorithm's state; the module docstring is the contract.

    ``optimizer``: the one whose steps drive the schedule, or a list in the order the loop steps them.  ``model``:
    the (possibly wrapped) model, or ``named_parameters`` where only those are at hand (Horovod).  ``engine``: the
    adapter's facts (default: from ``model``).  ``comm`` / ``process_group``: where the collectives go.  ``config=``
    (object, dict, JSON path) or keyword settings, not both.  Every rank builds it at the same point (a collective).
    """

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
        self.device = next((p.device for _, p in self.named_params), torch.device("cpu"))
        self.validate()  # local checks first: a bad setting raises on every rank before any collective
        self.comm = comm if comm is not None else comms.TorchComm(process_group, timeout_s=self.config.timeout_s,
                                                                  device=self.device)
        self.comm.device = self.device
        amp = AmpScaling(self.display_name, lambda: self.reduces_gradients)
        self.sync_context = SyncContext(self.comm, self.display_name, self.optimizer,
                                        NonfiniteGuard([n for n, _ in self.named_params]), amp, self.config,
                                        self.engine.tensors_changed, self.identical_named)
        self.alignment = StepAlignment(self, self.sync_context, self.parameter_set, amp)
        self.join_ended_by_engine = False  # an engine's Join hook ran end_join already (DDP's, before its broadcast)
        self.setup()
        verify_same_everywhere(self.comm, f"the {self.display_name} hook", {
            "config": to_dict(self.config), "world": self.comm.size, "version": __version__,
            "params": [(n, self.parameter_set.shape(p)) for n, p in self.named_params], **self.describe()})
        self.start()
        self.training_started = False
        if not self.engine.start_at_first_step:  # (else the engine calls it where the first step begins)
            self.start_training()
        self.parameter_set.warn_unoptimized(self.named_params, self.display_name)
        if not self.engine.drives_steps:
            self.alignment.hook(self.optimizers)
        if self.runs_apart:  # a run that ends between two syncs is warned about when the state goes
            self.sync_context.end = RunEnd(self.display_name)
            self.end_check = weakref.finalize(self, _warn_if_ended_apart, self.sync_context.end, weakref.ref(self))
        if self.engine.attach is not None:
            self.engine.attach(self)

    # ------------------------------------------------------------ the counters (kept by the sync context)
    step = property(lambda self: self.sync_context.step, lambda self, v: setattr(self.sync_context, "step", v))
    syncs = property(lambda self: self.sync_context.syncs, lambda self, v: setattr(self.sync_context, "syncs", v))
    skipped_steps = property(lambda self: self.sync_context.skipped_steps,
                             lambda self, v: setattr(self.sync_context, "skipped_steps", v))
    sync_steps = property(lambda self: self.sync_context.sync_steps, doc="Steps after which a sync completed.")

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

    # ------------------------------------------------------------ driven by engines
    def begin_step(self) -> None:
        """Before an iteration's first optimizer step, for engines that drive the steps: :meth:`before_step`."""
        with self.sync_context.phases.hook(before_step=True):
            if self._join_config is not None and self._join_config.enable:
                self.comm.notify_join(self)
            self.before_step()

    def end_step(self) -> None:
        """After each optimizer step (the last optimizer's post-hook): count it, then :meth:`after_step`."""
        self.alignment.end_step()

    def reduce_bucket(self, grads: List[torch.Tensor], params: List[torch.Tensor],
                      flat: Optional[torch.Tensor] = None) -> Work:
        """What engines call with each bucket of gradients: :meth:`reduce_gradients`, noting the parameters."""
        self.parameter_set.refuse_sparse(grads, params, flat, self.display_name)
        self.alignment.reduced.update(map(id, params))
        return self.reduce_gradients(grads, params, flat)

    def start_training(self, check: bool = True) -> None:
        """Once, before training: every rank from the first rank's weights (:func:`~.parameters.start_equal`), then
        :meth:`begin`.  At construction, unless the script sets the weights after it (Horovod's own order broadcasts
        them after building the optimizer: ``EngineFacts.start_at_first_step``, and the engine calls this where the
        first step begins).  ``check=False``: a checkpoint's weights are the start (they may differ on purpose)."""
        if self.training_started:
            return
        self.training_started = True
        if check and start_equal(self.comm, [p for _, p in self.named_params], self.float_buffers(),
                                 self.start_group(), self.display_name):
            self.sync_context.changed()
        self.begin()

    def not_a_training_step(self) -> None:
        """The next ``optimizer.step()`` is no training step (Horovod's state broadcast): not counted, nothing sent."""
        self.alignment.uncounted = True

    def optimizer_pre_step(self, optimizer) -> None:
        """The optimizer pre-hook's work, for frameworks that drive the steps (``EngineFacts(drives_steps=True)``)
        and know when the gradients are final (Lightning's ``on_before_optimizer_step``)."""
        self.alignment.pre_step(unwrap_optimizer(optimizer), unwrap_optimizer(optimizer) is self.optimizers[0])

    def optimizer_post_step(self, optimizer) -> None:
        """The counterpart of :meth:`optimizer_pre_step`, after the update."""
        if unwrap_optimizer(optimizer) is self.optimizers[-1]:
            self.end_step()

    def state_dict(self) -> dict:
        """The counters and :meth:`algorithm_state_dict`; NonFiniteError after a NaN/Inf gradient (``"raise"``) on
        this rank: no collective (a caller may ask one rank only), so the error counts no other rank."""
        if self.alignment.guard.seen() is not None:
            self.sync_context.raise_nonfinite(None, f"checkpoint after optimizer step {self.step}")
        return {"step": self.step, "syncs": self.syncs, "skipped_steps": self.skipped_steps,
                "config": to_dict(self.config), "meter": self.meter.snapshot(), **self.algorithm_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`, its tensors moved to the synced tensors' device first."""
        state = tensors_to(state, self.device)
        self.alignment.guard.clear()  # the weights loaded are those the checkpoint held, written only when finite
        self.step, self.syncs = int(state["step"]), int(state.get("syncs", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if "meter" in state:  # the bytes of the whole run, not only of the part since the resume
            self.meter.load(state["meter"])
        self.load_algorithm_state_dict(state)
        self.start_training(check=False)  # a start still pending: no check; begin() finds what the load left due

    def remove(self) -> None:
        """Unregister the optimizer hooks and hand AMP scaling back (a DDP comm hook stays until DDP is rebuilt)."""
        self.alignment.release()

    def sync_named(self) -> List[Tuple[str, torch.Tensor]]:
        """Everything a sync makes identical, by name; subclasses extend it."""
        return list(self.named_params) + [(f"buffer{i}", b) for i, b in enumerate(self.float_buffers())]

    def identical_named(self) -> List[Tuple[str, torch.Tensor]]:
        """What ``check_every`` compares: :meth:`sync_named`, unless a subclass's syncs land later."""
        return self.sync_named()

    # ------------------------------------------------------------ offered to algorithms
    def lr(self) -> float:
        """The lr a sync rule reads (:meth:`~.steps.SyncContext.lr`)."""
        return self.sync_context.lr()

    def float_buffers(self) -> List[torch.Tensor]:
        """The module's floating buffers (BatchNorm statistics), unless the engine re-broadcasts them."""
        return [] if self.engine.buffers_synced_each_forward else float_buffers(self.module)

    def average(self, tensors: Sequence[torch.Tensor], group=None, tag: str = "sync") -> None:
        """Average ``tensors`` in place over ``group`` (default: the world), the step proof riding along."""
        ctx = self.sync_context
        proof = ctx.proof()
        with ctx.failures(), ctx.phases.phase("exchange"):
            average_(self.comm, tensors, group=group, tag=tag, rider=proof)
        ctx.check(proof, group, tag)

    def synced(self, group=None, complete: bool = True) -> None:
        """Count a completed sync (:meth:`~.steps.SyncContext.synced`)."""
        self.sync_context.synced(group, complete)

    def refresh_parameters(self) -> List[str]:
        """Bring in parameters that became trainable or joined an optimizer since (a local check; a handshake
        only when something changed, on every rank that made the same change); returns their names."""
        new = self.parameter_set.new()
        if not new:
            return []
        verify_same_everywhere(self.comm, f"the {self.display_name} hook's new parameters",
                               {"new": [(n, tuple(p.shape)) for n, p in new], "step": self.step})
        self.parameter_set.add(new)
        self.alignment.guard.extend([n for n, _ in new])
        self.parameter_set.warn_unoptimized(new, self.display_name)
        self.parameters_added(new)
        return [n for n, _ in new]

    # ------------------------------------------------------------ the run's end
    def __enter__(self):
        """``with state:`` around the training loop: its exit ends the run synced (:meth:`finish`)."""
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:  # after an error the other ranks may not come: no collective then
            self.finish()
        return False

    def finish(self) -> None:
        """End the run with the same model on every rank (collective: every rank, after its last step)."""
        self.final_sync()
        self.note_the_end()

    def final_sync(self) -> None:
        """Sync if the last round was left open (the end of a run: ``finish()``, a Join with uneven inputs)."""
        self.joined = False
        if self.step and self.in_sync_at() != self.step:
            self.sync()

    def in_sync_at(self) -> Optional[int]:
        """The optimizer step right after which every rank last held the same weights (``None``: not yet): the
        last complete sync, or a later step an algorithm says left them equal (``sync_context.in_sync``)."""
        return self.sync_context.in_sync

    def note_the_end(self) -> None:
        """Where the run stands, for the end-of-run warning (:func:`_warn_if_ended_apart`)."""
        if self.sync_context.end is not None and self.sync_context.end.step:  # only a run that stepped here
            self.sync_context.end.step, self.sync_context.end.in_sync = self.step, self.in_sync_at()

    def use_scaler(self, scaler) -> None:
        """Keep a ``torch.amp.GradScaler``'s scale equal on every rank (the smallest, where they parted)."""
        self.alignment.scaler = scaler

    def __repr__(self) -> str:
        return f"{type(self).__name__}(step={self.step}, syncs={self.syncs})"


class RunEnd:
    """Where a run whose ranks differ between syncs stands: its last step counted in this process (0: none, then
    nothing to warn about, e.g. a state loaded and never stepped), and the step after which the ranks last held the
    same weights; kept up after each step, read by the end-of-run check once the state is gone."""

    def __init__(self, name: str):
        self.name, self.step, self.in_sync = name, 0, None


def _warn_if_ended_apart(end: RunEnd, ref) -> None:
    """The run is over (its state dropped, or the process exiting): warn if its last step left the ranks with
    different models.  Not after an uncaught error: its traceback is the news."""
    state = ref()
    if state is not None:  # the process is exiting with the state alive: ask it
        state.note_the_end()
    if getattr(sys, "last_value", None) is not None or end.step == 0 or end.in_sync == end.step:
        return
    warnings.warn(
        f"{end.name}: the run ended at step {end.step}, between two syncs: each rank holds its own model. Call "
        "state.finish() after the loop (or wrap it in `with state:`), or set total_steps (the last period then "
        "ends with a sync; commhooks train fills it from --steps, DeepSpeed from its scheduler's "
        "total_num_steps)", UserWarning, stacklevel=2)
