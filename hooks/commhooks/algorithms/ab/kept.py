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
        sent = self.meter.by_tag().get("ab-grad", 0)
        dense = self.ab_steps * self.parameter_set.allreduce_bytes()
        return {
            "phase": self.phase,
            "role": self.role,
            "group": list(self.group.ranks),
            "layers": layers,
            "params_dense": total,
            "params_factored": stored,
            "compression": round(total / stored, 2) if stored else 1.0,
            # what the AB steps saved: their bytes against plain allreduce's in the same steps
            "ab_steps": self.ab_steps,
            "ab_step_bytes": sent,
            "ab_step_allreduce_bytes": dense,
            "ab_step_traffic_ratio": round(dense / sent, 2) if sent else None,
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
        """The report as lines: each layer's rank, the bytes of each kind of step, and a traffic ratio only beside
        what the AB steps saved (the parameter compression is the factors' size, which saves traffic only where a
        group of several ranks sends the factor gradients: with groups of one an AB step sends nothing at all)."""
        r = self.report()
        lines = [f"AB report: step {r['step']}, phase {r['phase']}, role {r['role']} in group {r['group']}",
                 *format_layers(r)]
        share = f" ({r['bytes_vs_allreduce']:.1%} of plain allreduce's {size(r['allreduce_bytes'])})" if (
            r["bytes_vs_allreduce"] is not None) else ""
        lines.append(f"  syncs {r['syncs']}, {size(r['bytes'])} sent{share}")
        tags = r["bytes_by_tag"]
        kinds = (("full-grad", "warm-up and full-rank steps"), ("ab-grad", "AB steps"), ("sync", "syncs"),
                 ("sync-buffers", "syncs' buffers"), ("basis", "bases"))
        lines.append("  bytes by phase: " + ", ".join(f"{words} {size(tags[t])}" for t, words in kinds if t in tags)
                     + "".join(f", {t} {size(b)}" for t, b in sorted(tags.items()) if t not in dict(kinds)))
        if not r["ab_steps"]:
            lines.append("  no AB step yet")
        elif r["ab_step_bytes"]:
            lines.append(f"  AB steps: {r['ab_steps']}, sent {size(r['ab_step_bytes'])} where full-rank steps would "
                         f"have sent {size(r['ab_step_allreduce_bytes'])} ({r['ab_step_traffic_ratio']:.2f}:1 less)")
        else:
            lines.append(f"  AB steps: {r['ab_steps']}, sent nothing (groups of one rank: each trains its factor "
                         "alone until the sync), so the parameter compression saves no traffic here")
        return "\n".join(lines)

    def algorithm_state_dict(self) -> dict:
        return {
            "clock": dataclasses.asdict(self.clock),
            "last_switch": self.last_switch,
            "ab_steps": self.ab_steps,
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
        self.ab_steps = int(state.get("ab_steps", 0))  # (checkpoints written before it was kept: 0)
        self.ranks = dict(state["ranks"])
        # each layer's factors beside its weight (a model spread over devices keeps its layers where they are)
        self.bases = {n: Basis(**tensors_to(b, self._param[n].device)) for n, b in state["bases"].items()}
        self.entry = None if state.get("entry") is None else state["entry"].clone()
        self.note_agreement()
