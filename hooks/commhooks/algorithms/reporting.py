"""What a state tells its user: ``report()``, ``memory()``, the ``log_every`` line, a printable report.

Functions of the state, which keeps one-line delegates; an algorithm adds its
own figures through ``algorithm_report``, ``algorithm_memory`` and ``status``.
"""

from __future__ import annotations

from typing import Dict


def size(nbytes: float) -> str:
    """Bytes in a unit that shows them: ``1.64 kB``, ``19.28 MB`` (a small model's sends are not ``0.00 MB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def allreduce_bytes_per_step(state) -> int:
    """What plain data parallelism sends per rank per optimizer step: one fp32 allreduce payload of the
    model's trainable parameters (the baseline of ``report()["bytes_vs_allreduce"]``)."""
    params = (p for p in state.module.parameters() if p.requires_grad) if state.module is not None else (
        p for _, p in state.named_params)
    return 4 * sum(p.numel() for p in params)


def report(state) -> dict:
    """Steps, syncs, bytes sent (total and per tag), what plain allreduce would have sent, memory kept, plus the
    algorithm's own figures."""
    sent, dense = state.meter.bytes(), state.step * state.allreduce_bytes_per_step
    kept = state.memory()
    weights = sum(p.numel() * p.element_size() for _, p in state.named_params)
    return {"algorithm": state.name, "step": state.step, "syncs": state.syncs, "skipped_steps": state.skipped_steps,
            "bytes": sent, "bytes_by_tag": state.meter.by_tag(), "allreduce_bytes": dense,
            "bytes_vs_allreduce": round(sent / dense, 4) if dense else None,
            "memory_bytes": kept, "memory_vs_weights": round(kept["total"] / weights, 3) if weights else None,
            **state.algorithm_report()}


def memory(state) -> Dict[str, int]:
    """Bytes the algorithm keeps beyond the model and its optimizer, by kind, and their ``total``."""
    kinds = dict(state.algorithm_memory())
    first = state.alignment.guard.first
    if first is not None:
        kinds["nonfinite_guard"] = first.numel() * 8
    kinds["total"] = sum(kinds.values())
    return kinds


def log_line(state) -> str:
    """Step, the algorithm's status, syncs, bytes against plain allreduce."""
    sent, dense = state.meter.bytes(), state.step * state.allreduce_bytes_per_step
    share = f" ({sent / dense:.1%})" if dense else ""
    status = state.status()
    return (f"{state.display_name} step {state.step}{' | ' + status if status else ''} | syncs {state.syncs} | "
            f"sent {size(sent)}{share} of plain allreduce's {size(dense)}")


def format_report(state) -> str:
    """:func:`report` as lines for a log."""
    r = state.report()
    head = f"{type(state).__name__} report: step {r['step']}, syncs {r['syncs']}, {size(r['bytes'])} sent"
    rest = [f"  {k}: {v}" for k, v in r.items() if k not in ("algorithm", "step", "syncs", "bytes", "bytes_by_tag")]
    tags = "  bytes by tag: " + ", ".join(f"{t}={size(b)}" for t, b in sorted(r["bytes_by_tag"].items()))
    return "\n".join([head, *rest, tags])
