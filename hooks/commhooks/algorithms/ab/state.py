"""AB-training state: phases, bases, groups, and the gradient reduction of each step.

Coquelin et al., "AB-Training: A Communication-Efficient Approach for Distributed Low-Rank Learning", arXiv
2405.01067.

Each compressible weight W is split by SVD into ``A`` (m x k) and ``B`` (k x n).  The ranks form contiguous groups;
the first half of the groups train A with B frozen, the second half train B with A frozen, each group averaging only
inside itself and only the small factor gradient.  Every ``sync_period`` steps the world averages the weights,
trains ``F`` steps at full rank, re-computes a truncated basis and starts again.

Why W-space: the hook never changes the model or the optimizer.  An A-rank replaces its gradient G by ``mean_group(G
B^T) B``, a B-rank by ``A mean_group(A^T G)``; for SGD with momentum and weight decay this is exactly training the
factor (the update maps to W through the frozen factor, and momentum and decay are linear), which the tests check
against explicit factor parameters.  With Adam the element-wise normalisation is applied in W-space, so W drifts
slightly off the rank-k subspace between syncs; the syncs and re-bases bring it back.

Optimizer state at phase switches (the rule, tested):

* entering AB (after warm-up, and at each re-basis), the state of every compressed weight is cleared: the paper's
  factors start their phase with a fresh optimizer, and W-space momentum left from full rank would push W out of
  the factor's subspace.  Dense tensors keep their state.
* at each sync, the state of every parameter is cleared: the groups' states have diverged, and keeping them would
  make the ranks diverge again during the full-rank steps.  Adam restarts its bias correction; the LR rebound
  (:class:`~commhooks.algorithms.ab.LRRebound`) exists to soften exactly these restarts.

Tuning advice: ``rank_cutoff`` 0.15 (paper) keeps the components above 15 % of the largest singular value; lower it
for accuracy, raise it for traffic. Put the classifier head and embeddings in ``full_rank`` if accuracy drops.
``sync="with-stale"`` sends ``(m + n) k`` per layer at a sync instead of ``m n`` (the paper's default); ``full`` is
the exact world mean of W.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch

from ...comm import Work
from ...comm.base import flatten
from ...payload import compressed_mean
from ..averaging import clear_optimizer_state
from ..contract import AlgorithmState
from . import transitions
from .groups import make_groups
from .kept import ABKept
from .lowrank import Basis, tall_view
from .rebound import LRRebound
from .schedule import AB, ENTER, SYNC, Clock


def _optimizer_and_model(args, model, optimizer, kwargs):
    """``ABState(optimizer, model=model, ...)``'s arguments, and the order before 2026-12-05 (a
    DeprecationWarning); TypeError naming the right call otherwise."""
    if args and isinstance(args[0], torch.nn.Module):  # ABState(model, optimizer, ...): before 2026-12-05
        if model is not None or len(args) + (optimizer is not None) != 2:
            raise TypeError("ABState(optimizer, model=model, ...): the optimizer first, the model by keyword")
        warnings.warn("ABState(model, optimizer, ...) is deprecated: write ABState(optimizer, model=model, ...), "
                      "as every commhooks state takes them", DeprecationWarning, stacklevel=3)
        model, optimizer = args[0], args[1] if len(args) == 2 else optimizer
    elif len(args) > 1 or (args and optimizer is not None):
        raise TypeError(f"ABState takes one positional argument, the optimizer (got {len(args)}): "
                        "ABState(optimizer, model=model, ...)")
    elif args:
        optimizer = args[0]
    if optimizer is None:
        raise TypeError("ABState needs the optimizer: ABState(optimizer, model=model, ...)")
    if model is None and kwargs.get("named_parameters") is None and kwargs.get("engine") is None:
        raise ValueError("ABState needs the model or its named_parameters")
    return optimizer, model


class ABState(ABKept, AlgorithmState):
    """Hook state for AB-training.

    One line after building the DDP model and the optimizer::

        state = commhooks.ddp.register(ddp_model, optimizer, "configs/ab_mnist1d.json")

    or by hand: ``state = commhooks.ABState(optimizer, model=ddp_model, warmup_steps=300, sync_period=100,
    full_rank_steps=10, group_size=1)`` and ``ddp_model.register_comm_hook(state, commhooks.ab_hook)``. Keyword
    arguments are the fields of :class:`ABConfig`; ``config=`` takes a config object, dict or JSON path instead.
    ``named_parameters`` replaces the model where only those are at hand (Horovod); without the model, floating
    buffers are not averaged.  Built collectively: every rank constructs it at the same point (it creates the
    groups and, when ``warmup_steps == 0``, the first basis).
    """

    reduces_gradients = True

    @property
    def runs_apart(self) -> bool:
        """In AB phases the groups train different factors: their models differ until the sync."""
        return len(self.group_ranks) > 1

    def __init__(self, *args, model: Optional[torch.nn.Module] = None, optimizer=None, **kwargs):
        optimizer, model = _optimizer_and_model(args, model, optimizer, kwargs)
        super().__init__(optimizer, model=model, **kwargs)

    # ------------------------------------------------------------------ set-up
    @classmethod
    def groups_needed(cls, config, world_size, local_world_size):
        return make_groups(config, world_size, local_world_size)[0]

    def validate(self) -> None:
        self._param = dict(self.named_params)
        self.candidates = transitions.compressible(self.named_params, self.config.full_rank)

    def setup(self) -> None:
        self.group_ranks, self.group_roles = make_groups(self.config, self.comm.size, self.engine.local_world_size)
        self.clock = Clock()
        self.last_switch: Optional[int] = None
        self.bases: Dict[str, Basis] = {}  # compressed weights of the current AB phase
        self.ranks: Dict[str, Optional[int]] = {}  # rank per candidate at the last entry (None: kept dense)
        self.entry: Optional[torch.Tensor] = None  # compressed payload: the synced tensors as the AB phase began
        self.sync_buffers: Dict[str, torch.Tensor] = {}  # the compressed sync's send buffers, reused
        self.ab_steps = 0  # optimizer steps taken in an AB phase (the report's traffic comparison)

    def describe(self) -> dict:
        return {"groups": self.group_ranks}

    def start(self) -> None:
        names = [f"{r}{i}" for i, r in enumerate(self.group_roles)]
        self.groups = [self.comm.new_group(g, name=n) for g, n in zip(self.group_ranks, names)]
        mine = next(i for i, g in enumerate(self.group_ranks) if self.comm.rank in g)
        self.group, self.role = self.groups[mine], self.group_roles[mine]

    def begin(self) -> None:
        """The first phase (with ``warmup_steps`` 0, the first basis), from the start every rank shares."""
        self._advance()

    @property
    def phase(self) -> str:
        return self.clock.phase

    # --------------------------------------------------------------- schedule
    def before_step(self) -> None:
        """Under ``sync_rule="qsr"``, size an AB phase from the lr it starts with."""
        self.clock.size(self.step, self.lr, self.config, self.alignment.agree_on_period)

    def after_step(self) -> None:
        """Run the transitions due before the next step."""
        self.ab_steps += self.phase == AB
        self._advance()
        self.note_agreement()

    def note_agreement(self) -> None:
        """Warm-up and full-rank steps average every gradient over the world: the ranks agree after each (what
        ``in_sync_at`` answers, after a step and after a load)."""
        if self.phase != AB and self.step:
            self.sync_context.in_sync = self.step

    def _advance(self) -> None:
        for event in self.clock.advance(self.step, self.config):
            if event == SYNC:
                self.sync()
            elif event == ENTER:
                self._enter()
            self.last_switch = self.step

    # ------------------------------------------------------------- gradients
    def reduce_gradients(self, grads: List[torch.Tensor], params: List[torch.Tensor],
                         flat: Optional[torch.Tensor] = None) -> Work:
        """Start the reduction of one bucket's gradients, in place; return the in-flight work.

        Warm-up and full-rank steps: the world mean of the gradients (``flat``, if given, is the contiguous
        buffer the ``grads`` are views of, DDP's bucket: reduced without a copy).  AB steps: an A-rank sends
        ``G B^T``, a B-rank ``A^T G``, averaged inside its group, and hands back the W-space gradient; dense
        tensors are averaged in the group.
        """
        if self.phase != AB:
            return self.comm.allreduce([flat] if flat is not None else grads, op="mean", async_op=True, tag="full-grad")
        projected = []  # (W-space gradient view, basis, payload)
        payloads = []
        for g, p in zip(grads, params):
            basis = self.bases.get(self.parameter_set.name_of.get(id(p), ""))
            if basis is None:
                payloads.append(g)  # dense: averaged inside the group
                continue
            gm, _ = tall_view(g)
            payload = basis.payload(gm, self.role)
            payloads.append(payload)
            projected.append((gm, basis, payload))

        def to_w_space(reduced=None):
            for gm, basis, payload in projected:
                gm.copy_(basis.update(payload, self.role))
            return grads

        if self.config.local_group_steps:  # QSR inside the group: project locally, send nothing
            return Work(to_w_space)
        work = self.comm.allreduce(payloads, op="mean", group=self.group, async_op=True, tag="ab-grad")
        return work.then(to_w_space)

    # ----------------------------------------------------------------- phases
    def _enter(self) -> None:
        """New bases (rank agreed as the MAX over ranks), W = A B, the factors' optimizer state cleared."""
        first = self.clock.entries == 0
        untruncated = first and self.config.first_rank == "full"
        keep_residual = first and not self.config.truncate_first and not untruncated
        self.bases, self.ranks = transitions.enter(self.comm, self.candidates, self.config, keep_residual,
                                                   f"before step {self.step}", untruncated)
        if first and not self.bases:
            transitions.warn_nothing_compressed(self.step, self.candidates, self.config)
        clear_optimizer_state(self.optimizer, [self._param[n] for n in self.bases], self.engine.master_slices)
        self.sync_context.changed()
        if self.config.payload != "fp32":  # identical on every rank now: the reference of the sync's deltas
            tensors = transitions.phase_start_tensors(self._param, self.bases, self.config.sync)
            self.entry = flatten([t.detach().float() for t in tensors]).clone()

    def sync(self) -> None:
        """Average the groups' models over the world, leave AB, clear optimizer state."""
        self.refresh_parameters()
        tensors, write = transitions.sync_tensors(self._param, self.bases, self.role, self.config.sync)
        buffers = self.float_buffers()
        if self.entry is not None and self.entry.numel() == sum(t.numel() for t in tensors):
            self._average_changes(tensors)
            if buffers:
                self.average(buffers, tag="sync-buffers")
        else:  # fp32, or outside an AB phase (a forced sync during warm-up): the plain mean
            self.average(tensors + buffers, tag="sync")
        write()
        self.entry = None
        if self.phase == AB:  # the factors' phase ends; a forced sync in warm-up or full rank keeps the state
            clear_optimizer_state(self.optimizer, self._param.values(), self.engine.master_slices)
        self.bases = {}
        self.synced()

    def _average_changes(self, tensors: List[torch.Tensor]) -> None:
        """The world mean of ``tensors`` as the phase's start minus the mean of the ranks' changes since then,
        the changes sent compressed (``payload``) with the step proof (:func:`~commhooks.payload.compressed_mean`)."""
        ctx = self.sync_context
        with ctx.failures(), ctx.phases.phase("exchange"):  # (encoding, the allgather and decoding in one call)
            proofs = compressed_mean(self.comm, tensors, self.entry, self.config.codec, ctx.proof(),
                                     self.sync_buffers, tag="sync", seed=ctx.rounding_seed())
        ctx.check(proofs, None, "sync")

    def parameters_added(self, new) -> None:
        """Parameters that became trainable or joined an optimizer: synced from now on, kept dense."""
        self._param.update(dict(new))

    def final_sync(self) -> None:
        """The run's end: sync an open AB phase, which then ends as at a scheduled sync."""
        was_ab = self.phase == AB
        super().final_sync()
        if was_ab and self.sync_steps and self.sync_steps[-1] == self.step:
            self.clock.apply(SYNC, self.step)
            self.last_switch = self.step

    def wrap_scheduler(self, scheduler):
        """With ``rebound_steps > 0``: :class:`LRRebound` around ``scheduler``."""
        return LRRebound(scheduler, self) if self.config.rebound_steps > 0 else scheduler

    def __repr__(self) -> str:
        return f"ABState(step={self.step}, phase={self.phase}, role={self.role}, group={self.group.ranks}, syncs={self.syncs})"
