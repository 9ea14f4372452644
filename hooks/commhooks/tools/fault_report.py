"""What a fault run cost, from its record: the steps each attempt ran and redone, which faults hit training and
what each cost, and a table of runs.

A fault counts only if it hit training: after the first step of the attempt (or the live group's incarnation)
it hit, and before the run's last step.  The others are counted apart: a fault that hit a restart still starting
costs a restart but no step; one after the last step costs nothing.  How each is told from the record:

* restarts (``commhooks faults``): a fault's ``step`` is rank 0's step read from the progress file when it was
  injected; the injector removes that file when an attempt starts and rank 0 rewrites it after each step, so
  ``step`` None means the attempt had not finished a step, and ``step`` at the run's last step means training
  was over (the ranks were evaluating or saving).  The file is written at most every 0.05 s: a fault within
  0.05 s of an attempt's first step may be counted as hitting a start-up.
* live groups (``--torchft``): the progress file is shared by every group, so ``step`` says the job was training
  but not whether the killed group was.  The record does not hold when a restarted group joined; the proxy is
  the logs of the incarnation the fault hit (``group<g>.start<n>.log`` beside the record, or with several ranks a
  group ``group<g>.rank<r>.start<n>.log``: torchft's Manager server, on the group's rank 0, writes these lines):
  it hit training if that incarnation committed a step (torchft's ``should_commit=true``) before it was killed.
  Without the logs, a fault with a step counts as a hit (an upper bound).

A live group's heal time: from its restart (the record's wall clock, ``at_unix``) to the first step its new
incarnation committed (the timestamp of torchft's first ``should_commit=true`` line; torchft writes UTC, as this
machine's clock): the process's start-up, the quorum, the heal's transfer and one step.  ``quorum_s``: to the
first quorum it got (torchft's "got lighthouse quorum"), the start-up and the wait for the live group's next
sync.  Records without ``at_unix`` have none.  A restart whose first quorum held no group past step 0 found no live
group: it began the job again (steps lost, no heal to time).
"""

from __future__ import annotations

import json
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

HIT, STARTING, ENDED = "hit training", "hit a start-up", "after the last step"
KILL_KINDS = ("kill", "kill-node")  # noticed at once: a kill that hit an attempt is what ended it
# torchft's manager logs this line each time a group commits a step (torchft 0.2.0)
COMMITTED = re.compile(r"should_commit completed should_commit=true")
QUORUM = re.compile(r"got lighthouse quorum")
FIRST_QUORUM = re.compile(r"got lighthouse quorum .*participants: \[(.*)\]")  # every member, with its step
MEMBER_STEP = re.compile(r"\bstep: (\d+)")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+) ")  # torchft's own lines begin with the UTC time


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


def groups_identical(groups: List[dict]) -> Optional[bool]:
    """Whether the live groups that finished hold one model; None with fewer than two, where there is nothing to
    compare (one group finishing alone is trivially 'identical' and says nothing about healing)."""
    if len(groups) < 2:
        return None
    return len({g["params_sha256"] for g in groups}) == 1


def identical_cell(groups: List[dict]) -> str:
    """The table's word for :func:`groups_identical`, with how many groups it compared."""
    same = groups_identical(groups)
    if same is None:
        return f"n/a ({len(groups)} group{'' if len(groups) == 1 else 's'} finished)"
    return ("yes" if same else "NO") + f" ({len(groups)} finished)"


def last_step(report: dict) -> Optional[int]:
    """The run's last step: the faulted run's summary, else the fault-free run's, else ``--steps`` in its argv (a
    live run's summary is one group's, absent when that group was stopped at the end)."""
    for run in (report["faulted"], report.get("reference") or {}):
        if (run.get("summary") or {}).get("steps") is not None:
            return run["summary"]["steps"]
    argv = report.get("argv", [])
    return int(argv[argv.index("--steps") + 1]) if "--steps" in argv[:-1] else None


def restart_outcome(fault: dict, last: Optional[int]) -> str:
    """Restarts: a fault before its attempt's first step hit a start-up; at or after the last step, nothing."""
    if fault.get("step") is None:
        return STARTING
    return ENDED if last is not None and fault["step"] >= last else HIT


def incarnation_logs(fault: dict, record: dict, logs: Path) -> List[Path]:
    """Live groups: the logs (one per rank) of the target group's incarnation the fault hit (its newest start
    before the fault); those that exist."""
    g = fault["target"]
    starts = [r for r in record["restarts"] if r["group"] == g and r["at_s"] <= fault["injected_s"]]
    if starts:
        return [logs / name for name in starts[-1].get("logs", [starts[-1]["log"]]) if (logs / name).exists()]
    return sorted(logs.glob(f"group{g}.start0.log")) + sorted(logs.glob(f"group{g}.rank*.start0.log"))


def live_outcome(fault: dict, last: Optional[int], logs: Optional[Path], record: dict) -> str:
    """Live groups: the killed incarnation had committed a step (its logs), and the job was not over."""
    if fault.get("step") is not None and last is not None and fault["step"] >= last:
        return ENDED
    found = incarnation_logs(fault, record, logs) if logs is not None else []
    if found:
        return HIT if any(COMMITTED.search(log.read_text(errors="replace")) for log in found) else STARTING
    return STARTING if fault.get("step") is None else HIT  # no log: the job had trained (an upper bound)


def first_stamp(paths: List[Path], line: "re.Pattern") -> Optional[float]:
    """The earliest time (seconds since the epoch) of a torchft line matching ``line`` in any of ``paths``."""
    stamps = []
    for path in paths:
        for text in path.read_text(errors="replace").splitlines() if path.exists() else []:
            stamp = STAMP.match(text)
            if stamp and line.search(text):
                stamps.append(datetime.fromisoformat(stamp.group(1)).replace(tzinfo=timezone.utc).timestamp())
                break
    return min(stamps) if stamps else None


def heal_times(restart: Optional[dict], logs: Optional[Path]) -> dict:
    """A restart's seconds to its first quorum and to its first committed step (None where not known)."""
    if restart is None or logs is None or "at_unix" not in restart:
        return {"quorum_s": None, "heal_s": None}
    paths = [logs / name for name in restart.get("logs", [restart["log"]])]
    times = {key: first_stamp(paths, line) for key, line in (("quorum_s", QUORUM), ("heal_s", COMMITTED))}
    return {key: None if t is None else round(t - restart["at_unix"], 2) for key, t in times.items()}


def restart_costs(record: dict, outcomes: List[str]) -> List[dict]:
    """Restarts, per fault: the failure each hit ended and what it cost.  An attempt's failure is put on the
    first kill that hit it (a kill is noticed at once), else on its first fault that hit (a stall or a link down,
    noticed by the timeout); a later fault in that attempt was overtaken: its cost is already counted."""
    costs = [{"caused_failure": False, "detect_s": None, "steps_lost": 0} for _ in record["faults"]]
    for failure in record["failures"]:
        hits = [i for i, f in enumerate(record["faults"])
                if f.get("attempt") == failure["attempt"] and outcomes[i] == HIT]
        if not hits:
            continue  # the attempt failed while starting: a restart's cost, no step
        kills = [i for i in hits if record["faults"][i]["kind"] in KILL_KINDS]
        cause = (kills or hits)[0]
        costs[cause] = {"caused_failure": True, "steps_lost": failure.get("steps_lost") or 0,
                        "detect_s": round(failure["at_s"] - record["faults"][cause]["injected_s"], 2)}
    return costs


def fresh_start(restart: dict, logs: Optional[Path]) -> Optional[float]:
    """When a restarted group began the job again instead of healing: its first quorum had no member past torchft's
    step 0 (no live group was left to heal from; a live one would have been in it: the Lighthouse waits for every
    group that still beats).  The job second of that quorum, else None (it healed, never took a quorum, or the
    record has no wall clock for the restart: ``at_unix``)."""
    if logs is None or "at_unix" not in restart:
        return None
    for path in [logs / name for name in restart.get("logs", [restart["log"]])]:
        for text in path.read_text(errors="replace").splitlines() if path.exists() else []:
            found, stamp = FIRST_QUORUM.search(text), STAMP.match(text)
            if found is None or stamp is None:
                continue
            if any(int(step) > 0 for step in MEMBER_STEP.findall(found.group(1))):
                return None
            when = datetime.fromisoformat(stamp.group(1)).replace(tzinfo=timezone.utc).timestamp()
            return round(restart["at_s"] + when - restart["at_unix"], 2)
    return None


def lost_failures(record: dict, readings: List[tuple], logs: Optional[Path]) -> Dict[int, int]:
    """The failures that left no group alive, each with the job's step then (id -> steps lost).  Records with the
    restarts' wall clock: the last failure before a restart began the job again (:func:`fresh_start`; not the last
    start of a group stopped at the end: the others had finished).  Older records: the failure after which the
    recorded step fell (blind to a fall the job had made up by the next reading).  The step is the furthest read
    since the job last began: the progress file is group 0's rank 0's, behind the live group while group 0 is
    down, so then it is a lower bound."""
    ordered, lost, began = sorted(record["failures"], key=lambda x: x["at_s"]), {}, -1.0
    timed = any("at_unix" in r for r in record["restarts"])
    last = {r["group"]: r for r in record["restarts"]}  # each group's last start
    fresh = sorted(t for r in record["restarts"] for t in [fresh_start(r, logs)]
                   if t is not None and not (r["group"] in record.get("stopped_at_end", []) and last[r["group"]] is r))
    for i, failure in enumerate(ordered):
        nxt = ordered[i + 1]["at_s"] if i + 1 < len(ordered) else float("inf")
        after = [step for t, step in readings if t > failure["at_s"]]
        fell = failure.get("step") is not None and after and after[0] < failure["step"]
        if any(failure["at_s"] <= t < nxt for t in fresh) if timed else fell:
            lost[id(failure)] = max([step for t, step in readings if began < t <= failure["at_s"]] or [0])
            began = failure["at_s"]
    return lost


def live_costs(record: dict, outcomes: List[str], logs: Optional[Path] = None) -> List[dict]:
    """Live groups, per fault: the injector noticing the killed group's exit, the job's steps lost, and the heal
    of the restart that followed.  The job loses steps only when no group was left alive: with no checkpoints it
    began again at step 0 (:func:`lost_failures`); a restart that began the job again did not heal (its times are
    left out).  (The killed group's own steps since the last sync are not recorded: averaging, not steps, pays for
    them.)"""
    readings = sorted([(f["injected_s"], f["step"]) for f in record["faults"] if f.get("step") is not None]
                      + [(x["at_s"], x["step"]) for x in record["failures"] if x.get("step") is not None])
    lost = lost_failures(record, readings, logs)
    costs, claimed = [], set()  # a failure is put on one fault: the first that hit its group before it
    for fault, outcome in zip(record["faults"], outcomes):
        failure = next((x for x in sorted(record["failures"], key=lambda x: x["at_s"])
                        if x["group"] == fault["target"] and x["at_s"] >= fault["injected_s"]), None)
        if failure is None or outcome != HIT or id(failure) in claimed:
            costs.append({"caused_failure": False, "detect_s": None, "steps_lost": 0, "quorum_s": None,
                          "heal_s": None, "began_again": False})
            continue
        claimed.add(id(failure))
        restart = next((r for r in record["restarts"]
                        if r["group"] == fault["target"] and r["at_s"] >= failure["at_s"]), None)
        again = restart is not None and fresh_start(restart, logs) is not None
        costs.append({"caused_failure": True, "detect_s": round(failure["at_s"] - fault["injected_s"], 2),
                      "steps_lost": lost.get(id(failure), 0), "began_again": again,
                      **({"quorum_s": None, "heal_s": None} if again else heal_times(restart, logs))})
    return costs


def count_faults(report: dict, logs: Optional[Path] = None) -> List[dict]:
    """Every injected fault of one recorded run: its kind, whether it hit training (HIT, STARTING, ENDED), and
    for one that hit, whether it caused a failure (ended an attempt, or a live group), the time to notice it and
    the steps it cost.  ``logs`` is the faulted run's folder (the live path reads the incarnations' logs there)."""
    record, last = report["faulted"], last_step(report)
    live = "groups" in record
    summarize(record, record.get("summary"), record.get("wall_s", 0.0))  # each failure's steps_lost
    outcomes = [live_outcome(f, last, logs, record) if live else restart_outcome(f, last) for f in record["faults"]]
    costs = live_costs(record, outcomes, logs) if live else restart_costs(record, outcomes)
    return [{"kind": f["kind"], "outcome": o, **c} for f, o, c in zip(record["faults"], outcomes, costs)]


def spread(values: List[float]) -> str:
    """Seed noise in words: the min-max and the standard deviation over seeds, also as % of their mean."""
    if len(values) < 2:
        return "one seed: no spread"
    std = statistics.stdev(values)
    return (f"{min(values):.4f}-{max(values):.4f} (std {std:.4f}, {100 * std / statistics.mean(values):.1f} % of "
            f"their mean)")


def _fmt_stats(values: List[float], fmt: str) -> str:
    """mean / median (min-max) of a column of figures, or '-' when there are none."""
    if not values:
        return "-"
    return (f"{statistics.mean(values):{fmt}} / {statistics.median(values):{fmt}} "
            f"({min(values):{fmt}}-{max(values):{fmt}})")


def kind_rows(counted: List[dict]) -> List[dict]:
    """By fault kind over every run (and "**all**"): how many hit training, missed, caused a failure, and the time
    to detect, the steps lost and (live groups) the heal time of those that caused one (each a list of figures)."""
    rows = []
    for kind in sorted({c["kind"] for c in counted}) + ["**all**"]:
        mine = [c for c in counted if kind == "**all**" or c["kind"] == kind]
        caused = [c for c in mine if c["caused_failure"]]
        rows.append({"kind": kind, "injected": len(mine), **{o: sum(c["outcome"] == o for c in mine)
                                                             for o in (HIT, STARTING, ENDED)},
                     "caused a failure": len(caused), "detect_s": [c["detect_s"] for c in caused],
                     "steps_lost": [c["steps_lost"] for c in caused],
                     "heal_s": [c["heal_s"] for c in caused if c.get("heal_s") is not None],
                     "quorum_s": [c["quorum_s"] for c in caused if c.get("quorum_s") is not None]})
    return rows


def kind_table(rows: List[dict], live: bool = False) -> str:
    """:func:`kind_rows` as a markdown table (detect time, steps lost and, for live groups, the heal time of the
    restart that followed, restart to its first committed step: mean / median (min-max))."""
    head = ["kind", "injected", HIT, STARTING, ENDED, "caused a failure",
            "detect s: mean / median (range)", "steps lost: mean / median (range)"] + (
        ["heal s (restart to first commit): mean / median (range)"] if live else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(x) for x in [
            r["kind"], r["injected"], r[HIT], r[STARTING], r[ENDED], r["caused a failure"],
            _fmt_stats(r["detect_s"], ".2f"), _fmt_stats(r["steps_lost"], ".1f"),
            *([_fmt_stats(r["heal_s"], ".2f")] if live else [])]) + " |")
    return "\n".join(lines)


def table_data(paths: List[str]) -> dict:
    """The figures of recorded runs (``faults.json`` files): one row per run (keyed by the table's column names),
    the mean of each numeric column over the runs (seeds), the faults by kind, and for live runs the loss gap per
    seed beside the fault-free runs' spread.  What :func:`table` prints, and what the docs' claims read
    (``commhooks faults --table ... --json FILE``)."""
    rows, counted, live, gaps, fault_free, quality = [], [], False, [], [], None
    for path in paths:
        report = json.loads(Path(path).read_text())
        f, ref = report["faulted"], report.get("reference") or {}
        live = "groups" in f  # (one kind of run per table)
        faults = count_faults(report, Path(path).parent / "faulted")  # also derives the columns from the record
        counted += faults
        seen = f["groups"][0] if live and f["groups"] else (f.get("summary") or {})
        quality = "val_loss" if seen.get("val_loss") is not None else "test_acc"
        by = [sum(c["outcome"] == o for c in faults) for o in (HIT, STARTING, ENDED)]
        if live:
            got = round(statistics.mean(g[quality] for g in f["groups"]), 4)
            want = round(statistics.mean(g[quality] for g in ref.get("groups", [])), 4) if ref else None
            same, lost = identical_cell(f["groups"]), sum(c["steps_lost"] for c in faults)
        else:
            got, want = f["summary"][quality], ref.get("summary", {}).get(quality)
            same = "yes" if ref and f["summary"]["params_sha256"] == ref["summary"]["params_sha256"] else "NO"
            lost = f["steps_redone"]
        gap = f"{100 * (got / want - 1):+.1f} %" if want else "-"
        if want:
            gaps.append(100 * (got / want - 1))
            fault_free.append(want)
        rows.append([Path(path).parent.name, f["faults_injected"], *by, len(f["failures"]), len(f["restarts"]),
                     lost, f["wall_s"], ref.get("wall_s"), got, want] + ([gap] if live else []) + [same])
    head = ["run", "faults injected", HIT, STARTING, ENDED, "failures", "restarts",
            "steps lost (job started over)" if live else "steps redone", "wall s", "fault-free wall s",
            "final " + ("mean " if live else "") + (quality or "quality"), "fault-free"] + (
        ["gap", "groups identical"] if live else ["bit-identical to fault-free"])
    mean = {h: statistics.mean(r[i] for r in rows) for i, h in enumerate(head)
            if i and len(rows) > 1 and all(isinstance(r[i], (int, float)) for r in rows)}
    return {"live": live, "quality": quality, "head": head, "runs": [dict(zip(head, r)) for r in rows],
            "mean": mean, "gaps": gaps, "mean_gap": statistics.mean(gaps) if gaps else None,
            "fault_free": fault_free, "fault_free_std": statistics.stdev(fault_free) if len(fault_free) > 1 else None,
            "kinds": kind_rows(counted)}


def table(paths: List[str]) -> str:
    """Markdown tables of recorded runs (:func:`table_data`): one row per run, then the mean of each numeric
    column; then the faults by kind (hit training or not, time to detect, steps lost); for live runs, the
    fault-free runs' spread over seeds beside the loss gap."""
    data = table_data(paths)
    head, live = data["head"], data["live"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(run[h]) for h in head) + " |" for run in data["runs"]]
    if len(data["runs"]) > 1:  # the mean over the runs (seeds) of every numeric column
        mean = [f"{data['mean'][h]:.4g}" if h in data["mean"] else "" for h in head[1:]]
        if live and data["gaps"]:
            mean[head.index("gap") - 1] = f"{data['mean_gap']:+.1f} %"
        lines.append("| **mean** | " + " | ".join(mean) + " |")
    lines += ["", kind_table(data["kinds"], live)]
    if live and data["fault_free"]:
        lines += ["", f"Fault-free final {data['quality']} over the {len(data['fault_free'])} seeds: "
                      f"{spread(data['fault_free'])}; the gap with faults, per seed: "
                      f"{', '.join(f'{g:+.1f} %' for g in data['gaps'])}."]
    return "\n".join(lines)
