"""What a state tells its user: ``report()``, ``memory()``, the ``log_every`` line, a printable report.

:class:`Reporting` is a part of :class:`~.base.AlgorithmState` (it reads the
state's counters, meter and parameters); an algorithm adds its own figures
through ``algorithm_report``, ``algorithm_memory`` and ``status``.
"""

from __future__ import annotations

from typing import Dict


def size(nbytes: float) -> str:
    """Bytes in a unit that shows them: ``1.64 kB``, ``19.28 MB`` (a small model's sends are not ``0.00 MB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


class Reporting:
    """The reporting methods of every state (:class:`~.base.AlgorithmState` inherits them)."""

    @property
    def allreduce_bytes_per_step(self) -> int:
        """What plain data parallelism sends per rank per optimizer step: one fp32 allreduce payload of the
        model's trainable parameters (the baseline of ``report()["bytes_vs_allreduce"]``)."""
        params = (p for p in self.module.parameters() if p.requires_grad) if self.module is not None else (
            p for _, p in self.named_params)
        return 4 * sum(p.numel() for p in params)

    def report(self) -> dict:
        """What the algorithm did, as a plain dict for logs and your own logger (W&B, TensorBoard): steps,
        syncs, bytes sent (total and per tag), what plain allreduce would have sent, memory kept, plus
        :meth:`algorithm_report`."""
        sent, dense = self.meter.bytes(), self.step * self.allreduce_bytes_per_step
        kept = self.memory()
        weights = sum(p.numel() * p.element_size() for _, p in self.named_params)
        return {"algorithm": self.name, "step": self.step, "syncs": self.syncs, "skipped_steps": self.skipped_steps,
                "bytes": sent, "bytes_by_tag": self.meter.by_tag(), "allreduce_bytes": dense,
                "bytes_vs_allreduce": round(sent / dense, 4) if dense else None,
                "memory_bytes": kept, "memory_vs_weights": round(kept["total"] / weights, 3) if weights else None,
                **self.algorithm_report()}

    def memory(self) -> Dict[str, int]:
        """Bytes of device memory the algorithm keeps beyond the model and its optimizer, by kind (anchor,
        outer momentum, residual, sync buffers, syncs in flight, AB bases ...), and their ``total``.  Users
        size their runs by it: each fp32 copy of the synced tensors costs 4 bytes per element."""
        kinds = dict(self.algorithm_memory())
        first = self.alignment.guard.first
        if first is not None:
            kinds["nonfinite_guard"] = first.numel() * 8
        kinds["total"] = sum(kinds.values())
        return kinds

    def algorithm_memory(self) -> Dict[str, int]:
        """Subclass hook: the bytes the algorithm keeps, by kind."""
        return {}

    def algorithm_report(self) -> dict:
        """Subclass hook: the algorithm's own figures for :meth:`report`."""
        return {}

    def status(self) -> str:
        """Subclass hook: the algorithm's state in a few words, for the ``log_every`` line."""
        return ""

    def log_line(self) -> str:
        """The ``log_every`` line: step, the algorithm's :meth:`status`, syncs, bytes against plain allreduce."""
        sent, dense = self.meter.bytes(), self.step * self.allreduce_bytes_per_step
        share = f" ({sent / dense:.1%})" if dense else ""
        status = self.status()
        return (f"{self.display_name} step {self.step}{' | ' + status if status else ''} | syncs {self.syncs} | "
                f"sent {size(sent)}{share} of plain allreduce's {size(dense)}")

    def format_report(self) -> str:
        """:meth:`report` as lines for a log."""
        r = self.report()
        head = f"{type(self).__name__} report: step {r['step']}, syncs {r['syncs']}, {size(r['bytes'])} sent"
        rest = [f"  {k}: {v}" for k, v in r.items() if k not in ("algorithm", "step", "syncs", "bytes", "bytes_by_tag")]
        tags = "  bytes by tag: " + ", ".join(f"{t}={size(b)}" for t, b in sorted(r["bytes_by_tag"].items()))
        return "\n".join([head, *rest, tags])
