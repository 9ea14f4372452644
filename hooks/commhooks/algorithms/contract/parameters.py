"""The tensors a state covers, by name, and the ones that join or go missing while training runs.

A state syncs the model's trainable parameters (by name: config patterns match those), then any other tensor an
optimizer holds (named by its place in it), or the tensors an engine handed over instead (DeepSpeed's fp32 masters).
Training changes that set: a layer unfrozen or a parameter group added later is found before the next sync
(:meth:`ParameterSet.new`); a trainable parameter the engine never hands over (a layer unfrozen after DDP built its
buckets) is a *stray* the state reduces itself (:meth:`~.steps.StepAlignment.reduce_strays`).

:func:`start_equal`: every rank starts from the first rank's synced tensors, as DDP's constructor and Horovod's
``broadcast_parameters`` make them.  An engine may leave them different (DeepSpeed with replica groups broadcasts
inside each group only; a script that seeds no model), and a local method would then average the different starts at
its first sync.  One 32-byte fingerprint comparison per group at set-up (a host read); only where the starts differ,
a broadcast from the group's first rank (not metered, as the other start-up checks: every rank's report counts the
same training traffic), and a warning.  Set-up is the state's construction, or, where the script sets the weights
after it (Horovod's own order), where the first step begins (:meth:`~.state.AlgorithmState.start_training`).

And the small helpers every algorithm module uses: warnings that point at the user's line, the optimizer inside a
framework's wrapper, checkpoint tensors moved to a device; a state's config and optimizers from its arguments.
"""

from __future__ import annotations

import sys
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ...settings import ConfigError
from ...sources import from_fields, load_as
from ..averaging import local_part
from .checks import anywhere, same_everywhere

Named = List[Tuple[str, torch.Tensor]]


class ParameterSet:
    """The named tensors of a state; ``names_given``: the engine handed them over (not the module's own)."""

    def __init__(self, module: Optional[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]], master_slices: Optional[dict]):
        self.module, self.optimizers, self.slices = module, list(optimizers), master_slices or {}
        self.named: Named = self.collect(named_parameters)
        # the module's parameters are re-read at each sync, unless the engine handed over other tensors
        # (DeepSpeed's fp32 masters) to sync in their place
        own = {id(p) for p in module.parameters()} if module is not None else set()
        self.names_given = module is None or not {id(p) for _, p in self.named} <= own
        self.flat_ids = {id(flat) for flat, _, _ in self.slices.values()}  # optimizer parameters seen as views
        self.indexed()

    def indexed(self) -> None:
        """The lookups of :attr:`named` a step reads without a call: ``tensors``, ``ids``, ``name_of``."""
        self.tensors = [p for _, p in self.named]
        self.ids = set(map(id, self.tensors))
        self.name_of: Dict[int, str] = {id(p): n for n, p in self.named}

    def collect(self, named_parameters) -> Named:
        """The trainable parameters covered: the given ones or the module's (by name), then any other the
        optimizers hold (named by their place in them)."""
        if named_parameters is not None:
            named = list(named_parameters)
        elif self.module is not None:
            named = list(self.module.named_parameters())
        else:
            named = []
        named = [(n, p) for n, p in named if p.requires_grad or id(p) in self.slices]
        seen = {id(p) for _, p in named}
        seen |= {id(flat) for flat, _, _ in self.slices.values()}  # covered by its views
        for k, opt in enumerate(self.optimizers):
            where = "optimizer" if len(self.optimizers) == 1 else f"optimizer[{k}]"
            for i, group in enumerate(opt.param_groups):
                for j, p in enumerate(group["params"]):
                    if id(p) not in seen:
                        seen.add(id(p))
                        named.append((f"{where}.param_groups[{i}][{j}]", p))
        return named

    def optimized(self, p: torch.Tensor) -> torch.Tensor:
        """The optimizer's parameter that ``p`` is (a part of): ``p`` itself, or the flat master / the DTensor
        whose elements it views (``master_slices``)."""
        where = self.slices.get(id(p))
        return p if where is None else where[0]

    def gradient(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """``p``'s gradient: its own, or its stretch of the local part of its optimizer parameter's gradient
        (FSDP2's reduce-scattered shard).  A flat view, never a DTensor."""
        where = self.slices.get(id(p))
        if where is None:
            return p.grad
        flat, a, b = where
        return None if flat.grad is None else local_part(flat.grad).view(-1)[a:b]

    def shape(self, p: torch.Tensor) -> tuple:
        """The shape the ranks compare for ``p`` at set-up: a view stands for the optimizer parameter it is part
        of (the parts differ in size inside a shard group: FSDP2's uneven rows, ZeRO-3's padded partitions)."""
        where = self.slices.get(id(p))
        return tuple(p.shape) if where is None else tuple(where[0].shape)

    def repoint(self) -> List[str]:
        """Take again each view whose parameter's storage was replaced since (FSDP2 gives a DTensor new local
        storage when the module is moved or re-materialized, ``model.to_empty(...)``, ``model.to(...)``; the
        optimizer keeps the parameter, so a view of the old storage would be synced while training goes on
        in the new).  A host-side look at each view's address, before a sync touches them; returns the
        names."""
        moved = []
        for i, (name, p) in enumerate(self.named):
            where = self.slices.get(id(p))
            if where is None:
                continue
            flat, a, b = where
            now = local_part(flat).detach().view(-1)[a:b]
            if now.data_ptr() != p.data_ptr() or now.numel() != p.numel():
                view = now.view(p.shape)
                self.named[i] = (name, view)
                del self.slices[id(p)]
                self.slices[id(view)] = where
                moved.append(name)
        if moved:
            self.indexed()
        return moved

    def new(self) -> Named:
        """Parameters that became trainable or joined an optimizer since (local, no collective)."""
        current = self.collect(None if not self.names_given else list(self.named))
        known = {id(p) for _, p in self.named}
        return [(n, p) for n, p in current if id(p) not in known]

    def add(self, new: Named) -> None:
        self.named = self.named + list(new)
        self.indexed()

    def allreduce_bytes(self) -> int:
        """What plain data parallelism sends per rank per optimizer step: one fp32 allreduce payload of the
        model's trainable parameters (the baseline of ``report()["bytes_vs_allreduce"]``)."""
        params = (p for p in self.module.parameters() if p.requires_grad) if self.module is not None else (
            p for _, p in self.named)
        return 4 * sum(p.numel() for p in params)

    def unoptimized(self, named: Sequence[Tuple[str, torch.Tensor]]) -> List[str]:
        """Trainable model parameters of ``named`` in none of the optimizers (only for the module's own)."""
        if self.module is None or self.names_given:
            return []
        covered = {id(p) for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
        return [n for n, p in named if p.requires_grad and id(p) not in covered]

    def warn_unoptimized(self, named: Sequence[Tuple[str, torch.Tensor]], who: str) -> None:
        """Trainable model parameters in none of the optimizers given: another optimizer that steps them after a
        sync makes the ranks differ again, silently.  A warning on every rank, naming them."""
        missing = self.unoptimized(named)
        if missing:
            warnings.warn(
                f"{who}: trainable parameters in none of the optimizers given: {', '.join(missing[:8])}"
                f"{' ...' if len(missing) > 8 else ''} ({len(missing)}). If another optimizer steps them, its "
                "updates after each sync make the ranks differ: pass every optimizer, in the order the loop steps "
                "them (commhooks.ddp.register(ddp_model, [opt_a, opt_b], config), or optimizer=[opt_a, opt_b])",
                stacklevel=user_stacklevel())

    def refuse_sparse(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], flat, who: str) -> None:
        """ConfigError naming the parameters of a bucket whose gradient is sparse (a state that averages
        gradients cannot send one)."""
        if flat is not None and flat.layout != torch.strided:  # DDP hands a sparse gradient over as the buffer
            sparse = [self.name_of.get(id(p), "?") for p in params]
        else:
            sparse = [self.name_of.get(id(p), "?") for g, p in zip(grads, params) if g.layout != torch.strided]
        if sparse:
            raise ConfigError(
                f"{who} averages gradients here and {', '.join(sparse)} has a sparse one "
                "(nn.Embedding(sparse=True)?), which it cannot send. Build the layer with sparse=False; QSR without "
                "replica groups sends no gradients and takes sparse ones")


def start_equal(comm, params: List[torch.Tensor], buffers: List[torch.Tensor], group, who: str) -> bool:
    """Every rank starts from the first rank's ``params`` and ``buffers`` (``group``: that of this rank's shard
    across replica groups, None: the world; see the module docstring): where they differ, a broadcast and a
    warning on every rank.  True if the tensors changed (the engine must then refresh)."""
    if comm.size == 1:
        return False
    checks = [(params + buffers, None)] if group is None else [(params, group), (buffers, None)]
    fixed = []
    for tensors, over in checks:
        if not tensors or same_everywhere(comm, tensors, group=over):
            continue
        src = (over or comm.world).ranks[0]
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            comm.broadcast([t.data for t in tensors if t.dtype == dtype], src=src, group=over, tag="start",
                           metered=False)  # no training traffic: counted on the first rank only, reports would differ
        fixed.append("the synced tensors" if over is None else "the shards")
    if group is not None:  # shard groups decide apart: the engine's refresh (a collective) runs on all or none
        if anywhere(comm, bool(fixed), tag="start") and not fixed:
            fixed.append("another group's shards")
    if fixed:
        warnings.warn(
            f"{who}: the ranks started from different weights ({' and '.join(fixed)} differed); "
            "every rank now starts from the first rank's, as DDP's constructor and Horovod's "
            "broadcast_parameters do (seed the model the same on every rank, torch.manual_seed, to start there "
            "yourself)", stacklevel=user_stacklevel())
    return bool(fixed)


# ------------------------------------------------------------------ helpers

_PACKAGE = __file__.rsplit("/algorithms/", 1)[0]  # .../commhooks
_TORCH = torch.__file__.rsplit("/", 1)[0]


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the user's line (the first frame outside commhooks and
    torch: the ``optimizer.step()`` or ``engine.step()`` of the loop), however deep the hooks call it."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename.startswith(_TORCH)):
        frame, level = frame.f_back, level + 1
    return level


def unwrap_optimizer(optimizer):
    """The torch optimizer inside a framework's wrapper (Accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``: both keep it as ``.optimizer``); the optimizer itself otherwise.  The step hooks the
    state registers must sit on the optimizer whose ``step()`` really runs."""
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def tensors_to(obj, device: torch.device):
    """``obj`` (dicts, lists, tuples of tensors and plain values) with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: tensors_to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_to(v, device) for v in obj)
    return obj


def resolve_config(cls, config, settings: dict):
    """The config of state class ``cls`` from ``config=`` (object, dict, JSON path) or keyword ``settings``."""
    if config is not None and settings:
        raise ConfigError(f"pass either config= or keyword settings, not both (got {sorted(settings)})")
    return (load_as(cls.config_class, config) if config is not None
            else from_fields(cls.config_class, settings, where=cls.__name__))


def optimizer_list(optimizer) -> list:
    """``optimizer`` (one, or a list in the order the loop steps them) as a list of distinct torch optimizers,
    each unwrapped from a framework's wrapper."""
    opts = [unwrap_optimizer(o) for o in (list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])]
    for i, opt in enumerate(opts):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"optimizer[{i}] must be a torch.optim.Optimizer, got {type(opt).__name__}")
    if not opts or len({id(o) for o in opts}) != len(opts):
        raise ConfigError("optimizer must be an optimizer or a non-empty list of distinct optimizers")
    return opts
