"""AB-training state: phases, bases, groups, and the gradient reduction of each step.

Coquelin et al., "AB-Training: A Communication-Efficient Approach for
Distributed Low-Rank Learning", arXiv 2405.01067.

Each compressible weight W is split by SVD into ``A`` (m x k) and ``B``
(k x n).  The ranks form contiguous groups; the first half of the groups
train A with B frozen, the second half train B with A frozen, each group
averaging only inside itself and only the small factor gradient.  Every
``sync_period`` steps the world averages the weights, trains ``F`` steps at
full rank, re-computes a truncated basis and starts again.

Why W-space: the hook never changes the model or the optimizer.  An A-rank
replaces its gradient G by ``mean_group(G B^T) B``, a B-rank by
``A mean_group(A^T G)``; for SGD with momentum and weight decay this is
exactly training the factor (the update maps to W through the frozen factor,
and momentum and decay are linear), which the tests check against explicit
factor parameters.  With Adam the element-wise normalisation is applied in
W-space, so W drifts slightly off the rank-k subspace between syncs; the
syncs and re-bases bring it back.

Optimizer state at phase switches (the rule, tested):

* entering AB (after warm-up, and at each re-basis), the state of every
  compressed weight is cleared: the paper's factors start their phase with a
  fresh optimizer, and W-space momentum left from full rank would push W out
  of the factor's subspace.  Dense tensors keep their state.
* at each sync, the state of every parameter is cleared: the groups' states
  have diverged, and keeping them would make the ranks diverge again during
  the full-rank steps.  Adam restarts its bias correction; the LR rebound
  (:class:`~commhooks.ab.LRRebound`) exists to soften exactly these restarts.

Tuning advice: ``rank_cutoff`` 0.15 (paper) keeps the components above 15 %
of the largest singular value; lower it for accuracy, raise it for traffic.
Put the classifier head and embeddings in ``full_rank`` if accuracy drops.
``sync="with-stale"`` sends ``(m + n) k`` per layer at a sync instead of
``m n`` (the paper's default); ``full`` is the exact world mean of W.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from typing import Dict, List, Optional, Tuple

import torch

from .._version import __version__
from ..averaging import average_, buffers_broadcast_each_forward, clear_optimizer_state, float_buffers
from ..comm import Comm, Work
from ..config import ABConfig, ConfigError, from_dict, load_config, to_dict
from ..consistency import guard_gradients, nonfinite_anywhere, spread_over_ranks, verify_identical, verify_same_everywhere
from .groups import make_groups
from .lowrank import Basis, basis_from_svd, choose_rank, compression_ratio, svd, tall_view
from .schedule import AB, ENTER, SYNC, Clock, ab_phase_length, apply, events_before, needs_length


class ABState:
    """Hook state for AB-training; registers its own optimizer step post-hook.

    Two lines after building the DDP model and the optimizer::

        state = commhooks.ABState(ddp_model, optimizer, warmup_steps=300, sync_period=100,
                                  full_rank_steps=10, group_size=1)
        ddp_model.register_comm_hook(state, commhooks.ab_hook)

    Keyword arguments are the fields of :class:`~commhooks.config.ABConfig`;
    ``config=`` takes a config object, dict or JSON path instead.
    ``named_parameters`` replaces the model where only those are at hand
    (Horovod); without the model, floating buffers are not averaged.  Built
    collectively: every rank constructs it at the same point (it creates the
    groups and, when ``warmup_steps == 0``, the first basis).
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module],
        optimizer: torch.optim.Optimizer,
        *,
        named_parameters=None,
        process_group=None,
        comm: Optional[Comm] = None,
        config=None,
        **settings,
    ):
        if config is not None and settings:
            raise ConfigError(f"pass either config= or keyword settings, not both (got {sorted(settings)})")
        conf = load_config(config, kind="ab") if config is not None else from_dict(settings, kind="ab", where="ABState")
        if conf is None:
            raise ConfigError("ABState needs an 'ab' config, got type 'none'")
        self.config: ABConfig = conf
        self.engine_model = model
        self.model = getattr(model, "module", model)
        self.optimizer = optimizer
        if named_parameters is None and self.model is None:
            raise ValueError("ABState needs the model or its named_parameters")
        named = list(self.model.named_parameters() if named_parameters is None else named_parameters)
        named = [(n, p) for n, p in named if p.requires_grad]
        self._name = {id(p): n for n, p in named}
        self._param = {n: p for n, p in named}
        self.candidates = self._compressible(named)  # validated before any collective

        if comm is None:
            from ..comm.torch_dist import TorchComm

            comm = TorchComm(process_group, timeout_s=conf.timeout_s)
        self.comm = comm
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", comm.size))
        ranks, roles = make_groups(conf, comm.size, local_world)
        verify_same_everywhere(comm, "the AB hook", {"config": to_dict(conf), "world": comm.size, "groups": ranks,
                                                     "params": [(n, tuple(p.shape)) for n, p in named],
                                                     "version": __version__})
        self.groups = [comm.new_group(g, name=f"{r}{i}") for i, (g, r) in enumerate(zip(ranks, roles))]
        mine = next(i for i, g in enumerate(ranks) if comm.rank in g)
        self.group, self.role = self.groups[mine], roles[mine]
        self.sync_buffers = not buffers_broadcast_each_forward(model)

        self.step = 0
        self.clock = Clock()
        self.syncs = 0
        self.skipped_steps = 0
        self.last_switch: Optional[int] = None
        self.bases: Dict[str, Basis] = {}  # compressed weights of the current AB phase
        self.ranks: Dict[str, Optional[int]] = {}  # rank per candidate at the last entry (None: kept dense)
        self.scheduled_lr = lambda: float(optimizer.param_groups[0]["lr"])  # LRRebound points it past its ramp
        self._handles = [
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.begin_step()),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.end_step()),
        ]
        self._advance()

    # ------------------------------------------------------------------ set-up
    def _compressible(self, named) -> List[Tuple[str, torch.Tensor]]:
        patterns = self.config.full_rank
        for pat in patterns:
            if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named):
                sample = ", ".join(n for n, _ in named[:8])
                raise ConfigError(
                    f"ab.full_rank pattern {pat!r} matches no parameter (fnmatch on names such as {sample})"
                )
        return [
            (n, p) for n, p in named if p.ndim >= 2 and not any(fnmatch.fnmatchcase(n, pat) for pat in patterns)
        ]

    @property
    def meter(self):
        return self.comm.meter

    @property
    def phase(self) -> str:
        return self.clock.phase

    # --------------------------------------------------------------- schedule
    def begin_step(self) -> None:
        """Before each optimizer step: guard against NaN/Inf gradients; under ``sync_rule="qsr"``, size an AB
        phase from the lr it starts with."""
        if guard_gradients(list(self._param.items()), self.config.nonfinite, self.step, self.comm.rank):
            self.skipped_steps += 1
        if needs_length(self.clock, self.config):
            self.clock.phase_end = self.step + ab_phase_length(self.step, self.scheduled_lr(), self.config)

    def end_step(self) -> None:
        """After each optimizer step: count it and run the transitions due before the next one."""
        self.step += 1
        self._advance()

    def _advance(self) -> None:
        for event in events_before(self.step, self.clock, self.config):
            if event == SYNC:
                self._sync()
            elif event == ENTER:
                self._enter()
            apply(event, self.step, self.clock)
            self.last_switch = self.step

    # ------------------------------------------------------------- gradients
    def reduce_gradients(self, grads: List[torch.Tensor], params: List[torch.Tensor], flat: Optional[torch.Tensor] = None) -> Work:
        """Start the reduction of one bucket's gradients, in place; return the in-flight work.

        ``flat``, if given, is the contiguous buffer the ``grads`` are views
        of (DDP's bucket): full-rank steps then reduce it without a copy.
        """
        if self.phase != AB:
            tensors = [flat] if flat is not None else grads
            return self.comm.allreduce(tensors, op="mean", async_op=True, tag="full-grad")
        if self.config.local_group_steps:  # QSR inside the group: project locally, send nothing
            for g, p in zip(grads, params):
                basis = self.bases.get(self._name.get(id(p), ""))
                if basis is not None:
                    gm, _ = tall_view(g)
                    gm.copy_(basis.update(basis.payload(gm, self.role), self.role))
            return Work(lambda: grads)
        payloads, expand = [], []
        for g, p in zip(grads, params):
            basis = self.bases.get(self._name.get(id(p), ""))
            if basis is None:
                payloads.append(g)  # dense: averaged inside the group
                continue
            gm, _ = tall_view(g)
            payload = basis.payload(gm, self.role)
            payloads.append(payload)
            expand.append((gm, basis, payload))
        work = self.comm.allreduce(payloads, op="mean", group=self.group, async_op=True, tag="ab-grad")

        def to_w_space(reduced):
            for gm, basis, payload in expand:
                gm.copy_(basis.update(payload, self.role))
            return grads

        return work.then(to_w_space)

    # ----------------------------------------------------------------- phases
    @torch.no_grad()
    def _enter(self) -> None:
        """Compute the bases (rank agreed as the MAX over ranks), set W = A B, clear the factors' state."""
        cfg = self.config
        keep_residual = self.clock.entries == 0 and not cfg.truncate_first
        nonfinite_anywhere(self.comm, self.candidates, f"AB re-basis before step {self.step}: the SVD needs finite weights")
        mats = [tall_view(p.data)[0] for _, p in self.candidates]
        svds = [svd(m) for m in mats]
        local_k = [choose_rank(s, cfg.rank_cutoff) for _, s, _ in svds]
        ks = torch.tensor(local_k, dtype=torch.float64)
        self.comm.allreduce([ks], op="max", tag="basis")  # rank agreed as the max over all ranks
        self.bases, self.ranks = {}, {}
        for (name, p), mat, (u, s, vh), k in zip(self.candidates, mats, svds, ks.long().tolist()):
            m, n = mat.shape
            if compression_ratio(m, n, k) < cfg.min_compression_rate:
                self.ranks[name] = None
                continue
            self.bases[name] = basis_from_svd(u, s, vh, k, mat.dtype)
            self.ranks[name] = k
        self._agree_on_bases()
        for name, basis in self.bases.items():
            mat = tall_view(self._param[name].data)[0]
            if keep_residual:
                basis.residual = mat - basis.a @ basis.b
            else:
                mat.copy_(basis.a @ basis.b)  # the dropped singular values leave the model
        clear_optimizer_state(self.optimizer, [self._param[n] for n in self.bases])

    def _agree_on_bases(self) -> None:
        """Check the factors are identical on every rank; broadcast rank 0's where they are not."""
        if not self.bases or self.comm.size == 1:
            return
        names = sorted(self.bases)
        sums = torch.tensor(
            [float(t.double().sum()) for n in names for t in (self.bases[n].a, self.bases[n].b)], dtype=torch.float64
        )
        hi, lo = spread_over_ranks(self.comm, sums, tag="basis", metered=True)
        differ = [n for i, n in enumerate(names) if bool((hi[2 * i : 2 * i + 2] != lo[2 * i : 2 * i + 2]).any())]
        if differ:
            tensors = [t for n in differ for t in (self.bases[n].a, self.bases[n].b, self.bases[n].s)]
            self.comm.broadcast(tensors, src=0, tag="basis")

    @torch.no_grad()
    def _sync(self) -> None:
        """Average the groups' models over the world, leave AB, clear optimizer state."""
        compressed = self.bases
        extra = float_buffers(self.model) if self.sync_buffers else []
        if self.config.sync == "full" or not compressed:
            average_(self.comm, list(self._param.values()) + extra, tag="sync")
        else:  # with-stale: average each rank's factors, (m + n) k per layer
            mats = {n: tall_view(self._param[n].data)[0] for n in compressed}
            factors = {n: b.factors_after(mats[n], self.role) for n, b in compressed.items()}
            dense = [p for n, p in self._param.items() if n not in compressed]
            average_(self.comm, [t for pair in factors.values() for t in pair] + dense + extra, tag="sync")
            for n, (a, b) in factors.items():
                residual = compressed[n].residual
                mats[n].copy_(a @ b if residual is None else a @ b + residual)
        clear_optimizer_state(self.optimizer, self._param.values())
        self.bases = {}
        self.syncs += 1
        if self.config.check_every and self.syncs % self.config.check_every == 0:
            verify_identical(self.comm, list(self._param.items()), f"after AB sync {self.syncs} (step {self.step})")

    # ----------------------------------------------------------------- report
    def report(self) -> dict:
        """Per layer (name, shape, rank, compression) and the overall parameter compression.

        The overall figure is the paper's headline metric: parameters of the
        dense model over parameters of the factorised one (44.14:1 for VGG16).
        Ranks are those of the latest AB entry.
        """
        layers, stored, total = [], 0, 0
        for name, p in self._param.items():
            total += p.numel()
            k = self.ranks.get(name)
            if k is None:
                stored += p.numel()
                if p.ndim >= 2:
                    layers.append({"name": name, "shape": list(p.shape), "rank": None, "compression": 1.0})
                continue
            m, n = tall_view(p.data)[0].shape
            stored += (m + n) * k
            layers.append({"name": name, "shape": list(p.shape), "rank": k, "compression": round(compression_ratio(m, n, k), 2)})
        return {
            "phase": self.phase,
            "step": self.step,
            "role": self.role,
            "group": list(self.group.ranks),
            "layers": layers,
            "params_dense": total,
            "params_factored": stored,
            "compression": round(total / stored, 2) if stored else 1.0,
            "bytes_by_tag": self.meter.by_tag(),
        }

    def format_report(self) -> str:
        r = self.report()
        lines = [f"AB report: step {r['step']}, phase {r['phase']}, role {r['role']} in group {r['group']}"]
        for layer in r["layers"]:
            k = "dense" if layer["rank"] is None else f"rank {layer['rank']}"
            lines.append(f"  {layer['name']:<28} {str(tuple(layer['shape'])):<18} {k:<10} {layer['compression']:>7.2f}:1")
        lines.append(f"  overall parameter compression {r['compression']:.2f}:1 ({r['params_dense']} -> {r['params_factored']})")
        lines.append("  bytes by phase: " + ", ".join(f"{t}={b / 1e6:.2f}MB" for t, b in sorted(r["bytes_by_tag"].items())))
        return "\n".join(lines)

    # ---------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "clock": dataclasses.asdict(self.clock),
            "syncs": self.syncs,
            "skipped_steps": self.skipped_steps,
            "last_switch": self.last_switch,
            "ranks": dict(self.ranks),
            "bases": {
                n: {"a": b.a.clone(), "b": b.b.clone(), "s": b.s.clone(),
                    "residual": None if b.residual is None else b.residual.clone()}
                for n, b in self.bases.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state["bases"]) - set(self._param))
        if unknown:
            raise ValueError(f"checkpoint has bases for parameters this model lacks: {unknown}")
        self.step = int(state["step"])
        self.clock = Clock(**state["clock"])
        self.syncs = int(state["syncs"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.last_switch = state["last_switch"]
        self.ranks = dict(state["ranks"])
        self.bases = {n: Basis(**b) for n, b in state["bases"].items()}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def __repr__(self) -> str:
        return f"ABState(step={self.step}, phase={self.phase}, role={self.role}, group={self.group.ranks}, syncs={self.syncs})"
