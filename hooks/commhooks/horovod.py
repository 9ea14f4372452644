"""Horovod adapter: both hooks behind the usual ``DistributedOptimizer`` line.

Four changed lines for a Horovod user, and one at the end (``examples/horovod_train.py``)::

    import commhooks.horovod
    commhooks.horovod.init(config)                     # was: hvd.init()  (adds the process sets the algorithm needs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = commhooks.horovod.DistributedOptimizer(   # was: hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), hook="configs/ab_mnist1d.json")
    ...                                                # the loop, unchanged
    optimizer.comm_hook_state.finish()                 # the run ends with a sync

``hvd.broadcast_parameters`` may also come after the ``DistributedOptimizer`` line, as Horovod's own docs and
benchmark write it: the check that every rank starts from the same weights (a broadcast and a warning where they
do not) runs where the first step begins (``zero_grad``, the first gradient's reduction or ``step()``, whichever
comes first), after the script's own broadcasts.

Why a wrapper of our own: ``hvd.DistributedOptimizer`` always starts an
allreduce during backward (``skip_synchronize()`` only skips the wait), so
local SGD cannot ride on it.  This one keeps its contract: the same
``backward_passes_per_step`` meaning (gradients are *summed* over the passes,
then reduced), ``synchronize()``, ``skip_synchronize()`` for gradient
clipping, ``zero_grad()`` refusing to run with reductions in flight.  As in
Horovod, each parameter's reduction starts from a hook as soon as its
gradient is accumulated (``register_post_accumulate_grad_hook``), so
communication overlaps the rest of the backward pass; ``step()`` waits for
them in an optimizer pre-hook.  Only an algorithm that declares
``reduces_gradients`` gets gradients; a local method starts no reduction and
averages the parameters from its own step hook.  An algorithm's groups are
Horovod process sets.

Without a hook (``hook=None`` or ``{"type": "none"}``) it returns Horovod's
own ``hvd.DistributedOptimizer``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import facts, launch_horovod, registry
from .config import ConfigError, load_config


def process_set_ranks(config, world_size: int, local_world_size: int):
    """The rank lists of the static process sets ``config``'s algorithm will need (groups of >= 2 ranks,
    short of the world), as the algorithm declares them; ``config`` may be a list of configs (a job that
    builds several hooks): the union of their sets, each once."""
    found = []
    for one in (config if isinstance(config, (list, tuple)) else [config]):
        conf = load_config(one)
        if conf is None:
            continue
        groups = registry.for_config(conf).state_class.groups_needed(conf, world_size, local_world_size)
        found += [list(g) for g in groups if 1 < len(g) < world_size and list(g) not in found]
    return found


def init(config=None, **hvd_kwargs):
    """``hvd.init()`` under any launcher, with static process sets for the groups ``config``'s algorithm needs
    (a list of configs: the groups of all of them).

    Under ``horovodrun`` it is ``hvd.init()``.  Under ``mpirun`` / ``mpiexec``
    / ``srun`` / ``torchrun`` (Horovod built without MPI, as here) it first
    brings up Horovod's Gloo controller the way horovodrun does (the launch
    code's :func:`commhooks.launch_horovod.bootstrap_gloo`).  Then, whatever
    the launcher, a world that differs from the launcher's is a LaunchError
    on every rank.
    """
    import horovod.torch as hvd

    from .launch import check_world_size, discover

    placement = discover()
    if placement is not None and placement.source == "horovod":
        check_world_size(placement.world_size, "Horovod (HOROVOD_SIZE)")  # before sets are planned for it
    if (placement is not None and placement.source != "horovod" and placement.world_size > 1
            and not hvd.is_initialized()):
        launch_horovod.bootstrap_gloo(placement)
    sets = []
    if placement is not None and "process_sets" not in hvd_kwargs:
        sets = process_set_ranks(config, placement.world_size, placement.local_world_size)
    if sets:
        hvd_kwargs["process_sets"] = [hvd.ProcessSet(r) for r in sets]
    hvd.init(**hvd_kwargs)
    check_world_size(hvd.size(), "Horovod (hvd.size())")
    return hvd


class _HookedOptimizer:
    """Methods of the wrapper; :func:`DistributedOptimizer` mixes them into a subclass of your optimizer's class.

    The wrapper shares the original optimizer's ``param_groups`` and ``state``
    (it is a shallow copy), so lr schedulers, checkpoints and step hooks see
    one optimizer.  It does not override ``step()``: torch already wraps the
    parent's ``step`` with the step-hook machinery, and a second wrapper
    would run every hook twice.
    """

    def _commhooks_init(self, named_parameters, conf, backward_passes_per_step, model):
        from .comm.horovod_comm import HorovodComm

        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        named = list(named_parameters) if named_parameters is not None else [
            (f"param.{i}.{j}", p) for i, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])
        ]
        self.backward_passes_per_step = backward_passes_per_step
        self._params = [p for _, p in named if p.requires_grad]
        self._param_names = {p: n for n, p in named if p.requires_grad}
        self._delay = {p: backward_passes_per_step for p in self._params}
        self._works = {}
        self._synchronized = False
        self._should_synchronize = True
        # ours first: gradients are reduced before the algorithm's own pre-hook (its NaN guard) looks at them
        self.register_step_pre_hook(lambda opt, args, kwargs: self._before_step())
        self.register_step_post_hook(lambda opt, args, kwargs: setattr(self, "_synchronized", False))
        comm = HorovodComm()
        hvd = comm.hvd
        # the script may broadcast the weights after this line (Horovod's own order): the ranks' start is checked
        # where the first step begins (start_training, from zero_grad, _start and _before_step)
        engine = facts.for_model(model, local_world_size=hvd.local_size(), start_at_first_step=True)
        state_class = registry.for_config(conf).state_class
        self.comm_hook_state = state_class(optimizer=self, model=model, named_parameters=named, engine=engine,
                                           comm=comm, config=conf)
        self._reduces = self.comm_hook_state.reduces_gradients
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._params] if self._reduces else []

    def _start(self, p):
        self.comm_hook_state.start_training()  # (once: a backward before any zero_grad or step)
        if p.grad is None:  # an unused parameter: the other ranks may have a gradient for it
            p.grad = torch.zeros_like(p)
        state = self.comm_hook_state
        # gradient hooks fire in autograd's order, which may differ between ranks: Horovod pairs calls by name,
        # so each parameter's reduction is named after the parameter (as in hvd.DistributedOptimizer)
        with state.comm.keyed(self._param_names[p]):
            self._works[p] = state.reduce_bucket([p.grad], [p])

    def _grad_ready(self, p):
        if p in self._works:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally."
            )
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._start(p)

    def synchronize(self):
        """Wait for every gradient reduction (starting those whose hooks did not fire)."""
        if self._reduces:
            for p in self._params:
                if p not in self._works:
                    self._start(p)
            for work in self._works.values():
                work.wait()
            self._works.clear()
        for p in self._params:
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); clip...; with optimizer.skip_synchronize(): optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _before_step(self):
        if not self.state and _inside_horovod_broadcast():
            # hvd.broadcast_optimizer_state initialises an empty optimizer state with a step on zero gradients:
            # no training step, nothing to reduce (Horovod's own DistributedOptimizer is bypassed there too)
            self.comm_hook_state.not_a_training_step()
            return
        self.comm_hook_state.start_training()
        if self._should_synchronize and not self._synchronized:
            self.synchronize()

    def zero_grad(self, set_to_none: bool = True):
        self.comm_hook_state.start_training()  # a Horovod loop's first line: the ranks' start, before the forward
        if self._works:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(): the gradients are still being reduced"
            )
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def _inside_horovod_broadcast() -> bool:
    """Whether this optimizer step is the one ``hvd.broadcast_optimizer_state`` makes to create the state."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "broadcast_optimizer_state" and "horovod" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _accept_horovod_defaults(hvd, kwargs) -> None:
    """The ``hvd.DistributedOptimizer`` arguments a hook can honour: those at the values that leave the
    communication to it (Horovod's own defaults, which its examples pass explicitly); any other value is a
    ConfigError naming the argument and why."""
    why = {
        "compression": (lambda v: v is hvd.Compression.none or getattr(v, "__name__", "") == "NoneCompressor",
                        "the hook decides what is sent (its own low-rank or local-SGD payloads); use "
                        "hvd.Compression.none"),
        "op": (lambda v: v == hvd.Average, "the hook averages (a sum or Adasum would change its maths); use hvd.Average"),
        "gradient_predivide_factor": (lambda v: v == 1.0, "the hook computes the mean itself; use 1.0"),
        "num_groups": (lambda v: not v, "the hook groups its own tensors; use 0"),
        "groups": (lambda v: v is None, "the hook groups its own tensors; use None"),
        "sparse_as_dense": (lambda v: v in (False, True), "a bool"),
        "process_set": (lambda v: v is hvd.global_process_set or v is None,
                        "the hook's groups come from its config (commhooks.horovod.init creates their process sets); "
                        "use the global process set"),
    }
    for key, value in kwargs.items():
        if key not in why:
            raise TypeError(f"DistributedOptimizer() got an unexpected keyword argument {key!r}")
        ok, reason = why[key]
        if not ok(value):
            raise ConfigError(f"hvd.DistributedOptimizer argument {key}={value!r} cannot be honoured with a comm "
                              f"hook: {reason}")


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    hook=None,
    backward_passes_per_step: int = 1,
    model: Optional[torch.nn.Module] = None,
    **horovod_kwargs,
):
    """Horovod's ``DistributedOptimizer`` with a commhooks algorithm deciding the communication.

    ``hook``: a config object, dict or JSON path of any registered algorithm.
    ``model`` (optional) lets the algorithm average floating buffers (BatchNorm) at syncs.
    Horovod's own arguments are accepted at the values that leave the communication to the hook
    (``compression=hvd.Compression.none``, ``op=hvd.Average``, ... as Horovod's examples pass them);
    other values raise a ConfigError saying why.
    The algorithm's state is ``optimizer.comm_hook_state`` (meter,
    ``state_dict()``).  Build it on every rank at the same point: an algorithm may create
    its process sets collectively.
    """
    import horovod.torch as hvd

    conf = load_config(hook)
    if conf is None:
        return hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                        backward_passes_per_step=backward_passes_per_step, **horovod_kwargs)
    _accept_horovod_defaults(hvd, horovod_kwargs)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), {
        k: v for k, v in _HookedOptimizer.__dict__.items() if not k.startswith("__") or k == "__doc__"
    })
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # shares param_groups, state, defaults and step hooks
    wrapped._commhooks_init(named_parameters, conf, backward_passes_per_step, model)
    return wrapped
