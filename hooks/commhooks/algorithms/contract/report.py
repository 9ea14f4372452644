"""What a state tells its user: ``report()`` (steps, syncs, bytes sent against what plain allreduce of the same
tensors would send, memory kept), ``memory()``, the ``log_every`` line, and byte counts a person reads."""

from __future__ import annotations

import logging
from typing import Dict

log = logging.getLogger("commhooks")


class Reporting:
    """The state's methods that tell its user what it did (a mixin of :class:`~.state.AlgorithmState`)."""

    def report(self) -> dict:
        """What the algorithm did, a plain dict for your logger: steps, syncs, bytes (by tag, against allreduce)."""
        return report(self)

    def memory(self) -> Dict[str, int]:
        """Device memory the algorithm keeps beyond the model and its optimizer, by kind, and ``total``."""
        return memory(self)

    def format_report(self) -> str:
        """:meth:`report` as lines for a log."""
        return format_report(type(self).__name__, self.report())

    def log(self) -> None:
        """The ``log_every`` line (rank 0, logger ``commhooks``, INFO)."""
        log.info(log_line(self))


def report(state) -> dict:
    """:meth:`~.state.AlgorithmState.report`: steps, syncs, bytes sent (total and per tag), what plain allreduce would have
    sent, memory kept, the time per step of each phase and the share of overlapped syncs hidden, plus the
    algorithm's own figures."""
    sent, dense = state.meter.bytes(), state.step * state.parameter_set.allreduce_bytes()
    kept = state.memory()
    weights = sum(p.numel() * p.element_size() for _, p in state.named_params)
    return {"algorithm": state.name, "step": state.step, "syncs": state.syncs, "skipped_steps": state.skipped_steps,
            "bytes": sent, "bytes_by_tag": state.meter.by_tag(), "allreduce_bytes": dense,
            "bytes_vs_allreduce": round(sent / dense, 4) if dense else None,
            "memory_bytes": kept, "memory_vs_weights": round(kept["total"] / weights, 3) if weights else None,
            # the run's length and warm-up as the state uses them (an integration may have filled them in from
            # the trainer's scheduler: the only place a user sees that it did)
            "schedule": {k: getattr(state.config, k) for k in getattr(type(state.config), "schedule_keys", {})},
            # where this process's steps spent their time, phase by phase (commhooks/phases.py)
            **state.sync_context.phases.report(state.sync_context.phases.steps),
            **state.algorithm_report()}


def memory(state) -> Dict[str, int]:
    """:meth:`~.state.AlgorithmState.memory`: the algorithm's kinds (anchor, outer momentum, residual, sync buffers, syncs
    in flight, AB bases ...), the NaN guard's record, and their ``total``."""
    kinds = dict(state.algorithm_memory())
    first = state.alignment.guard.first  # the NaN guard's record
    if first is not None:
        kinds["nonfinite_guard"] = first.numel() * 8
    kinds["total"] = sum(kinds.values())
    return kinds


def log_line(state) -> str:
    """The ``log_every`` line: step, the algorithm's :meth:`~.state.AlgorithmHooks.status`, syncs, bytes against plain
    allreduce."""
    sent, dense = state.meter.bytes(), state.step * state.parameter_set.allreduce_bytes()
    share = f" ({sent / dense:.1%})" if dense else ""
    status = state.status()
    return (f"{state.display_name} step {state.step}{' | ' + status if status else ''} | syncs {state.syncs} | "
            f"sent {size(sent)}{share} of plain allreduce's {size(dense)}")


def format_report(name: str, r: dict) -> str:
    """A :meth:`~.state.AlgorithmState.report` as lines for a log."""
    head = f"{name} report: step {r['step']}, syncs {r['syncs']}, {size(r['bytes'])} sent"
    rest = [f"  {k}: {v}" for k, v in r.items() if k not in ("algorithm", "step", "syncs", "bytes", "bytes_by_tag")]
    tags = "  bytes by tag: " + ", ".join(f"{t}={size(b)}" for t, b in sorted(r["bytes_by_tag"].items()))
    return "\n".join([head, *rest, tags])


def size(nbytes: float) -> str:
    """Bytes in a unit that shows them: ``1.64 kB``, ``19.28 MB`` (a small model's sends are not ``0.00 MB``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
