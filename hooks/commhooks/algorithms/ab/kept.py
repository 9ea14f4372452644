"""What an AB state keeps and tells: its checkpoint (the phase clock, the bases of the open AB phase, the ranks),
its memory, its report (per layer: shape, rank, compression; the paper's parameter compression)."""

from __future__ import annotations

import dataclasses
from typing import Dict

from ..contract.parameters import tensors_to
from ..contract.report import size
from .lowrank import Basis, format_layers, layer_compression
from .schedule import Clock


class ABKept:
    """A mixin of :class:`~.state.ABState`: ``algorithm_state_dict`` and its load, ``algorithm_memory``,
    ``algorithm_report``, ``status``, ``format_report``."""

    def algorithm_report(self) -> dict:
        """Per layer (name, shape, rank, compression) and the overall parameter compression.

        The overall figure is the paper's headline metric: parameters of the dense model over parameters of
        the factorised one (44.14:1 for VGG16). Ranks are those of the latest AB entry.
        """
        layers, total, stored = layer_compression(self._param, self.ranks)
        return {
            "phase": self.phase,
            "role": self.role,
            "group": list(self.group.ranks),
            "layers": layers,
            "params_dense": total,
            "params_factored": stored,
            "compression": round(total / stored, 2) if stored else 1.0,
        }

    def algorithm_memory(self) -> Dict[str, int]:
        """The bases of the current AB phase (A, B and the singular values; the residual W - AB of the first
        phase when it is kept), the phase's starting point for compressed syncs and their reused buffers."""
        size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        out = {"ab_bases": sum(size(b.a) + size(b.b) + size(b.s) for b in self.bases.values()),
               "ab_residuals": sum(size(b.residual) for b in self.bases.values()),
               "ab_phase_start": size(self.entry), "sync_buffers": sum(map(size, self.sync_buffers.values()))}
        return {k: v for k, v in out.items() if v}

    def status(self) -> str:
        compressed = sum(1 for k in self.ranks.values() if k is not None)
        return f"phase {self.phase} | {compressed}/{len(self.ranks) or len(self.candidates)} layers compressed"

    def format_report(self) -> str:
        r = self.report()
        lines = [f"AB report: step {r['step']}, phase {r['phase']}, role {r['role']} in group {r['group']}",
                 *format_layers(r)]
        share = f" ({r['bytes_vs_allreduce']:.1%} of plain allreduce's {size(r['allreduce_bytes'])})" if (
            r["bytes_vs_allreduce"] is not None) else ""
        lines.append(f"  syncs {r['syncs']}, {size(r['bytes'])} sent{share}")
        lines.append("  bytes by phase: " + ", ".join(f"{t}={size(b)}" for t, b in sorted(r["bytes_by_tag"].items())))
        return "\n".join(lines)

    def algorithm_state_dict(self) -> dict:
        return {
            "clock": dataclasses.asdict(self.clock),
            "last_switch": self.last_switch,
            "ranks": dict(self.ranks),
            "entry": None if self.entry is None else self.entry.clone(),
            "bases": {
                n: {"a": b.a.clone(), "b": b.b.clone(), "s": b.s.clone(),
                    "residual": None if b.residual is None else b.residual.clone()}
                for n, b in self.bases.items()
            },
        }

    def load_algorithm_state_dict(self, state: dict) -> None:
        unknown = sorted(set(state["bases"]) - set(self._param))
        if unknown:
            raise ValueError(f"checkpoint has bases for parameters this model lacks: {unknown}")
        self.clock = Clock(**state["clock"])
        self.last_switch = state["last_switch"]
        self.ranks = dict(state["ranks"])
        # each layer's factors beside its weight (a model spread over devices keeps its layers where they are)
        self.bases = {n: Basis(**tensors_to(b, self._param[n].device)) for n, b in state["bases"].items()}
        self.entry = None if state.get("entry") is None else state["entry"].clone()
        self.note_agreement()
