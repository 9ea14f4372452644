"""What a fault run cost, from its record: the steps each attempt ran and redone, and a table of runs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import List, Optional

def summarize(record: dict, summary: Optional[dict], wall_s: float) -> dict:
    """The steps each attempt ran (rank 0's step when it failed, sampled each 0.05 s, less the step it resumed
    from; an attempt killed before it resumed ran none), and the steps redone: all steps run less the run's."""
    record["wall_s"] = round(wall_s, 2)
    record["faults_injected"] = len(record["faults"])
    record["summary"] = summary
    if "groups" in record:  # live groups: the others redo nothing, a restarted group skips to their step
        return record
    resumed = {0: 0, **{r["attempt"]: r["resumed_from"] for r in record["restarts"]}}
    ended = {f["attempt"]: f["step"] for f in record["failures"]}
    if summary is not None:
        ended[max(resumed)] = summary["steps"]
    for a in resumed:  # an attempt that trained without saying "resumed from" found no checkpoint: it began at 0
        if resumed[a] is None and ended.get(a) is not None:
            resumed[a] = 0
    ran = {a: max(0, ended[a] - resumed[a]) if resumed[a] is not None and ended.get(a) is not None else 0
           for a in resumed}
    for failure in record["failures"]:  # the work this failure threw away: back to the next attempt that resumed
        later = [resumed[a] for a in sorted(resumed) if a > failure["attempt"] and resumed[a] is not None]
        failure["steps_lost"] = (max(0, failure["step"] - later[0]) if later and failure["step"] is not None
                                 else 0 if failure["step"] is None else None)
    record["steps_run"] = sum(ran.values())
    record["steps_redone"] = None if summary is None else record["steps_run"] - summary["steps"]
    return record


def table(paths: List[str]) -> str:
    """A markdown table of recorded runs (``faults.json`` files): one row per run, then the mean of each numeric
    column."""
    rows, live = [], False
    for path in paths:
        report = json.loads(Path(path).read_text())
        f, ref = report["faulted"], report.get("reference") or {}
        live = "groups" in f  # (one kind of run per table)
        summarize(f, f.get("summary"), f["wall_s"])  # the derived columns, from what was recorded
        seen = f["groups"][0] if live and f["groups"] else (f.get("summary") or {})
        quality = "val_loss" if seen.get("val_loss") is not None else "test_acc"
        kinds = ", ".join(sorted({x["kind"] for x in f["faults"]}))
        if live:
            got = statistics.mean(g[quality] for g in f["groups"])
            want = statistics.mean(g[quality] for g in ref.get("groups", [])) if ref else None
            same = ("yes" if f["groups_identical"] else "NO") + f" ({f.get('groups_finished', len(f['groups']))} finished)"
            redone = "-"
        else:
            got, want = f["summary"][quality], ref.get("summary", {}).get(quality)
            same = "yes" if ref and f["summary"]["params_sha256"] == ref["summary"]["params_sha256"] else "NO"
            redone = f["steps_redone"]
        rows.append([Path(path).parent.name, f"{f['faults_injected']} ({kinds})", len(f["failures"]),
                     len(f["restarts"]), redone, f["wall_s"], ref.get("wall_s"), got, want, same])
    head = ["run", "faults injected", "failures", "restarts", "steps redone", "wall s", "fault-free wall s",
            "final " + ("mean " if live else "") + quality, "fault-free", "groups identical" if live else
            "bit-identical to fault-free"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    if len(rows) > 1:  # the mean over the runs (seeds) of every numeric column
        mean = [f"{statistics.mean(r[i] for r in rows):.4g}" if all(isinstance(r[i], (int, float)) for r in rows)
                else "" for i in range(1, len(head))]
        lines.append("| **mean** | " + " | ".join(mean) + " |")
    return "\n".join(lines)
