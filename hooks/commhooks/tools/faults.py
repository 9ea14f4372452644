"""``commhooks faults``: run a training job, inject faults on a seeded schedule, restart it, and count the cost.

    commhooks faults --ranks 4 --nodes 2 --mtbf 20 --kinds kill,stall,link-down --seed 0 --reference \\
        --out results/faults-run -- --config configs/qsr_mnist1d.json --steps 3000 --checkpoint-seconds 5
    commhooks faults --table results/faults-run/faults.json     # a markdown table of recorded runs

Everything after ``--`` goes to ``commhooks train`` on every rank.  The injector plays torchelastic's part (a
rank that fails ends the attempt; every rank restarts from the newest complete checkpoint, ``--resume auto``)
and a cluster's bad day:

* ``kill``: SIGKILL of one rank (a crash, an OOM kill); ``kill-node``: of every rank of a node;
* ``stall``: SIGSTOP of one rank for ``--stall-s``, then SIGCONT (a swapping or hung host): shorter than the
  hook's ``timeout_s`` it only costs time, longer it is a collective timeout on the other ranks;
* ``link-down``: a node's link taken down (``ip link set ... down``) for ``--down-s``;
* ``throttle``: a node's link limited to ``--throttle-rate`` by ``tc`` for ``--down-s``.

There is no added latency or random packet loss: this kernel has no ``netem``, and the injector does not fake
it.  Link faults need the benchmark's network namespaces (root); without them the run says so and refuses
those kinds.  Fault times are drawn from an exponential distribution with mean ``--mtbf`` seconds of job wall
time (a Poisson process), from ``--seed``; ``--at`` gives an exact list instead.

The report (``faults.json`` in ``--out``) lists each fault, each failure (the ranks that failed, the time
from the fault to the failure, each rank's last error line), each restart (the step it resumed from, the
steps redone), and the run's wall time and summary; ``--reference`` also runs the job once without faults
and compares the final parameters (a SHA-256 of their bytes: exact resume makes them equal), the quality
figure and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..launch import free_port
from .bench import LabError, NetnsLab, remove_stale_lab, stop_workers

KINDS = ("kill", "kill-node", "stall", "link-down", "throttle")
LINK_KINDS = ("link-down", "throttle")


@dataclass
class Fault:
    at_s: float  # job wall time, seconds
    kind: str
    target: int  # a rank (kill, stall) or a node (kill-node, link-down, throttle)
    duration_s: float = 0.0
    at_step: Optional[int] = None  # instead of at_s: once rank 0 reports this step (``--at @400:kill:1``)
    attempt: Optional[int] = None  # the attempt it hit (filled in when injected)
    step: Optional[int] = None  # rank 0's step when injected (sampled: the progress file is written each 0.05 s)


def schedule(kinds: List[str], mtbf_s: float, horizon_s: float, seed: int, ranks: int, nodes: int,
             stall_s: float, down_s: float) -> List[Fault]:
    """Faults at exponential gaps of mean ``mtbf_s`` up to ``horizon_s``, kind and target drawn from ``seed``."""
    rng, t, faults = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return faults
        kind = rng.choice(kinds)
        target = rng.randrange(nodes if kind in ("kill-node",) + LINK_KINDS else ranks)
        faults.append(Fault(round(t, 2), kind, target, stall_s if kind == "stall" else
                            down_s if kind in LINK_KINDS else 0.0))


def parse_at(text: str) -> List[Fault]:
    """``--at 8:link-down:1:12,@400:kill:2``: time (s) or ``@step`` (rank 0's), kind, target[, duration (s)]."""
    faults = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        try:
            if len(parts) not in (3, 4) or parts[1] not in KINDS:
                raise ValueError
            at_step = int(parts[0][1:]) if parts[0].startswith("@") else None
            faults.append(Fault(0.0 if at_step is not None else float(parts[0]), parts[1], int(parts[2]),
                                float(parts[3]) if len(parts) == 4 else 0.0, at_step=at_step))
        except ValueError:
            raise ValueError(f"--at {item!r}: expected time:kind:target[:duration] (time in seconds, or @step) "
                             f"with kind one of {KINDS}") from None
    return faults


@dataclass
class Attempt:
    """One start of every rank."""
    index: int
    started_s: float
    procs: list = field(default_factory=list)
    logs: List[Path] = field(default_factory=list)


class Injector:
    """Starts the ranks, applies the faults, restarts after a failure; the report is :attr:`record`."""

    def __init__(self, args, train_argv: List[str], out: Path, lab: Optional[NetnsLab], faults: List[Fault]):
        self.args, self.train_argv, self.out, self.lab, self.faults = args, train_argv, out, lab, faults
        self.progress = out / "progress"
        self.t0 = time.monotonic()
        self.undo: List[tuple] = []  # (due_s, action, fault)
        self.record: Dict[str, list] = {"faults": [], "failures": [], "restarts": []}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def step(self) -> Optional[int]:
        try:
            return int(self.progress.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    # ------------------------------------------------------------------ ranks

    def start(self, index: int) -> Attempt:
        attempt = Attempt(index, self.now())
        self.progress.unlink(missing_ok=True)  # a step fault waits for this attempt's own steps
        self.exited: Dict[int, float] = {}  # rank -> job time it exited (sampled each 0.05 s)
        port = free_port("127.0.0.1")
        for r in range(self.args.ranks):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(self.args.ranks), MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", LOCAL_RANK=str(r % self.per_node), LOCAL_WORLD_SIZE=str(self.per_node))
            for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "COMMHOOKS_WIRE_IFACE"):
                env.pop(k, None)
            cmd = [sys.executable, "-m", "commhooks.tools.train", *self.train_argv, "--no-progress",
                   "--checkpoint-dir", str(self.out / "checkpoints"), "--resume", "auto",
                   "--progress-file", str(self.progress), "--json-out", str(self.out / "summary.rank{rank}.json")]
            if self.lab is not None:
                env.update(MASTER_ADDR=self.lab.addr(0), GLOO_SOCKET_IFNAME=self.lab.iface(r))
                cmd = ["ip", "netns", "exec", self.lab.ns(r), *cmd]
            else:
                env.update(MASTER_ADDR="127.0.0.1")
            log = self.out / f"attempt{index}.rank{r}.log"
            attempt.logs.append(log)
            with open(log, "w") as f:  # its own process group: a kill or a stop reaches all of it
                attempt.procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                                      start_new_session=True))
        return attempt

    @property
    def per_node(self) -> int:
        return self.args.ranks // self.args.nodes

    def ranks_of(self, node: int) -> List[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    # ------------------------------------------------------------------ faults

    def due(self, fault: Fault) -> bool:
        if fault.at_step is None:
            return fault.at_s <= self.now()
        step = self.step()
        return step is not None and step >= fault.at_step

    def _signal(self, attempt: Attempt, ranks: List[int], sig) -> None:
        for r in ranks:
            try:
                os.killpg(attempt.procs[r].pid, sig)
            except ProcessLookupError:
                pass

    def _link(self, node: int, *cmd: str) -> None:
        rank = node * self.per_node
        subprocess.run(["ip", "netns", "exec", self.lab.ns(rank), *[c.format(dev=self.lab.iface(rank)) for c in cmd]],
                       capture_output=True, check=True)

    def inject(self, fault: Fault, attempt: Attempt) -> None:
        fault.attempt, fault.step = attempt.index, self.step()
        now = self.now()
        if fault.kind == "kill":
            self._signal(attempt, [fault.target], signal.SIGKILL)
        elif fault.kind == "kill-node":
            self._signal(attempt, self.ranks_of(fault.target), signal.SIGKILL)
        elif fault.kind == "stall":
            self._signal(attempt, [fault.target], signal.SIGSTOP)
            self.undo.append((now + fault.duration_s, "cont", fault, attempt))
        elif fault.kind == "link-down":
            self._link(fault.target, "ip", "link", "set", "{dev}", "down")
            self.undo.append((now + fault.duration_s, "up", fault, attempt))
        elif fault.kind == "throttle":
            self._link(fault.target, "tc", "qdisc", "replace", "dev", "{dev}", "root", "tbf", "rate",
                       self.args.throttle_rate, "burst", "32kbit", "latency", "50ms")
            self.undo.append((now + fault.duration_s, "unthrottle", fault, attempt))
        self.record["faults"].append({**asdict(fault), "injected_s": round(now, 2)})
        print(f"[faults] {now:7.1f}s  {fault.kind} {'node' if fault.kind in ('kill-node',) + LINK_KINDS else 'rank'} "
              f"{fault.target}" + (f" for {fault.duration_s:g}s" if fault.duration_s else "")
              + f" (step ~{fault.step})", flush=True)

    def undo_due(self, everything: bool = False) -> None:
        keep = []
        for due, action, fault, attempt in self.undo:
            if not everything and self.now() < due:
                keep.append((due, action, fault, attempt))
            elif action == "cont":
                self._signal(attempt, [fault.target], signal.SIGCONT)
            elif action == "up":
                self._link(fault.target, "ip", "link", "set", "{dev}", "up")
            elif action == "unthrottle":
                self.lab.shape(self.args.bandwidth, "0ms")
        self.undo = keep

    # ------------------------------------------------------------------ the job

    def run(self) -> dict:
        pending = list(self.faults)
        index, attempt = 0, self.start(0)
        try:
            while True:
                codes = self.poll(attempt)
                if all(c == 0 for c in codes):
                    break
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    self.fail(attempt, failed)
                    if index >= self.args.max_restarts:
                        raise RuntimeError(f"gave up after {index} restarts")
                    while any(due > self.now() for due, action, *_ in self.undo if action != "cont"):
                        time.sleep(0.1)  # a link comes back before the restart (a stalled rank is gone anyway)
                    self.undo_due(everything=True)
                    index += 1
                    attempt = self.start(index)
                    self.record["restarts"].append({"attempt": index, "at_s": round(self.now(), 2)})
                    continue
                for fault in [f for f in pending if self.due(f)][:1]:  # in order, one per poll
                    pending.remove(fault)
                    self.inject(fault, attempt)
                self.undo_due()
                time.sleep(0.05)
        finally:
            stop_workers(attempt.procs)
            self.undo_due(everything=True)
        self.record["not_injected"] = [asdict(f) for f in pending]  # the job ended first
        for restart in self.record["restarts"]:
            resumed = _resumed_from(self.out / f"attempt{restart['attempt']}.rank0.log")
            restart["resumed_from"] = resumed
        return self.record

    def poll(self, attempt: Attempt) -> List[Optional[int]]:
        codes = [p.poll() for p in attempt.procs]
        for r, code in enumerate(codes):
            if code is not None and r not in self.exited:
                self.exited[r] = round(self.now(), 2)
        return codes

    def fail(self, attempt: Attempt, failed: List[int]) -> None:
        """An attempt is over: note who failed, when, and why (each rank's last error line), and stop the rest."""
        when = self.now()
        end = time.monotonic() + self.args.grace_s  # the other ranks' own errors, before they are stopped
        while None in self.poll(attempt) and time.monotonic() < end:
            time.sleep(0.05)
        stop_workers(attempt.procs)  # a stopped rank too: SIGKILL ends it
        times = [f["injected_s"] for f in self.record["faults"] if f["attempt"] == attempt.index]
        self.record["failures"].append({
            "attempt": attempt.index, "at_s": round(when, 2), "failed_ranks": failed, "step": self.step(),
            # from the attempt's first and last fault (which one caused it, the errors say)
            "after_fault_s": round(when - min(times), 2) if times else None,
            "after_last_fault_s": round(when - max(times), 2) if times else None,
            "exits": {r: p.returncode for r, p in enumerate(attempt.procs)},
            "exited_s": {r: t for r, t in self.exited.items()},
            "errors": {r: _last_error(log) for r, log in enumerate(attempt.logs)}})
        print(f"[faults] {when:7.1f}s  rank(s) {failed} failed; restarting every rank", flush=True)


def _last_error(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if re.search(r"Error|error:|Killed|fault", ln)]
    return lines[-1].strip()[:400] if lines else ""


def _resumed_from(log: Path) -> Optional[int]:
    found = re.search(r"resumed from \S+ at step (\d+)", log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1)) if found else None


class LiveInjector(Injector):
    """``--torchft``: one process per replica group over torchft, a Lighthouse in this process; a group that
    fails is started again on its own (after ``--restart-delay``) and heals from a live one: no one else stops."""

    LIVE_KINDS = ("kill", "stall")

    def __init__(self, args, train_argv, out, faults):
        super().__init__(args, train_argv, out, None, faults)
        from torchft.coordination import LighthouseServer

        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000,
                                           heartbeat_timeout_ms=int(1000 * args.heartbeat_s))

    @property
    def per_node(self) -> int:
        return 1  # a group is one process

    def start_group(self, attempt: Attempt, g: int) -> None:
        env = dict(os.environ, RANK=str(g), WORLD_SIZE=str(self.args.ranks), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "commhooks.tools.train", *self.train_argv, "--no-progress", "--backend", "torchft",
               "--lighthouse", self.lighthouse.address(), "--progress-file", str(self.progress),
               "--json-out", str(self.out / "summary.rank{rank}.json")]
        log = self.out / f"group{g}.start{attempt.index}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        if g < len(attempt.procs):
            attempt.procs[g], attempt.logs[g] = proc, log
        else:
            attempt.procs.append(proc)
            attempt.logs.append(log)

    def run(self) -> dict:
        pending, restarts = list(self.faults), []  # (due_s, group)
        attempt = Attempt(0, 0.0)
        self.exited = {}
        for g in range(self.args.ranks):
            self.start_group(attempt, g)
        ending = None  # once a group has finished: the others get --grace-s to finish too (a restart is off)
        try:
            while True:
                codes = [p.poll() for p in attempt.procs]
                if all(c == 0 for c in codes) and not restarts:
                    break
                if ending is None and 0 in codes:
                    ending = self.now() + self.args.grace_s
                    self.record["restarts_cancelled"] = [g for _, g in restarts]
                    restarts.clear()
                if ending is not None and self.now() > ending:  # a group that had not rejoined by the end
                    self.record["stopped_at_end"] = [g for g, c in enumerate(codes) if c is None]
                    break
                for g, code in enumerate(codes):
                    if code not in (None, 0) and ending is None and all(r != g for _, r in restarts):
                        self.record["failures"].append({"group": g, "at_s": round(self.now(), 2), "exit": code,
                                                        "step": self.step(), "error": _last_error(attempt.logs[g])})
                        if sum(1 for f in self.record["failures"]) > self.args.max_restarts:
                            raise RuntimeError(f"gave up after {self.args.max_restarts} restarts")
                        restarts.append((self.now() + self.args.restart_delay, g))
                        print(f"[faults] {self.now():7.1f}s  group {g} exited ({code}); it starts again in "
                              f"{self.args.restart_delay:g}s and heals from a live group", flush=True)
                for due, g in [r for r in restarts if r[0] <= self.now()]:
                    restarts.remove((due, g))
                    attempt.index += 1
                    self.start_group(attempt, g)
                    self.record["restarts"].append({"group": g, "at_s": round(self.now(), 2),
                                                    "log": attempt.logs[g].name})
                for fault in [f for f in pending if self.due(f)][:1]:
                    pending.remove(fault)
                    if attempt.procs[fault.target].poll() is None:
                        self.inject(fault, attempt)
                self.undo_due()
                time.sleep(0.05)
        finally:
            stop_workers(attempt.procs)
            self.undo_due(everything=True)
            self.lighthouse.shutdown()
        self.record["not_injected"] = [asdict(f) for f in pending]
        return self.record


# ------------------------------------------------------------------ the command


def summarize(record: dict, summary: Optional[dict], wall_s: float) -> dict:
    """The steps each attempt ran (rank 0's step when it failed, sampled each 0.05 s, less the step it resumed
    from; an attempt killed before it resumed ran none), and the steps redone: all steps run less the run's."""
    record["wall_s"] = round(wall_s, 2)
    record["faults_injected"] = len(record["faults"])
    record["summary"] = summary
    if record["restarts"] and "attempt" not in record["restarts"][0]:  # live groups: nothing is redone by the others
        return record
    resumed = {0: 0, **{r["attempt"]: r["resumed_from"] for r in record["restarts"]}}
    ended = {f["attempt"]: f["step"] for f in record["failures"]}
    if summary is not None:
        ended[max(resumed)] = summary["steps"]
    ran = {a: max(0, ended[a] - resumed[a]) if resumed[a] is not None and ended.get(a) is not None else 0
           for a in resumed}
    for failure in record["failures"]:  # the work this failure threw away: back to the next attempt that resumed
        later = [resumed[a] for a in sorted(resumed) if a > failure["attempt"] and resumed[a] is not None]
        failure["steps_lost"] = (max(0, failure["step"] - later[0]) if later and failure["step"] is not None
                                 else 0 if failure["step"] is None else None)
    record["steps_run"] = sum(ran.values())
    record["steps_redone"] = None if summary is None else record["steps_run"] - summary["steps"]
    return record


def run_job(args, train_argv: List[str], out: Path, lab: Optional[NetnsLab], faults: List[Fault]) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # an earlier job's checkpoints would be resumed from
    out.mkdir(parents=True, exist_ok=True)
    injector = LiveInjector(args, train_argv, out, faults) if args.torchft else Injector(args, train_argv, out, lab, faults)
    record = injector.run()
    if args.torchft:  # every group's own summary: they must end identical
        groups = [json.loads((out / f"summary.rank{g}.json").read_text()) for g in range(args.ranks)
                  if (out / f"summary.rank{g}.json").exists() and g not in record.get("stopped_at_end", [])]
        record["groups"] = [{k: s.get(k) for k in ("heals", "retries", "joined_at", "params_sha256", "test_acc",
                                                    "val_loss", "syncs")} for s in groups]
        record["groups_identical"] = len(groups) == args.ranks and len({s["params_sha256"] for s in groups}) == 1
    if not args.keep_checkpoints:  # a run's record is its logs and summaries; the checkpoints can be large
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    path = out / "summary.rank0.json"
    return summarize(record, json.loads(path.read_text()) if path.exists() else None, injector.now())


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="commhooks faults", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (network namespaces), ranks split evenly")
    p.add_argument("--bandwidth", default="unlimited", help="each node's link (a tc rate such as 100mbit)")
    p.add_argument("--kinds", default="kill,kill-node,stall,link-down", help=f"comma list of {KINDS}")
    p.add_argument("--mtbf", type=float, default=30.0, help="mean seconds between faults (job wall time)")
    p.add_argument("--horizon", type=float, default=None, help="no fault after this many seconds (default 10 MTBFs)")
    p.add_argument("--at", default=None, help="exact faults instead: time:kind:target[:duration],...")
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (not the training seed)")
    p.add_argument("--stall-s", type=float, default=20.0, help="how long a stalled rank stays stopped")
    p.add_argument("--down-s", type=float, default=20.0, help="how long a link stays down or throttled")
    p.add_argument("--throttle-rate", default="1mbit", help="a throttled link's tc rate")
    p.add_argument("--torchft", action="store_true",
                   help="live recovery: one process per replica group over torchft (--ranks groups, loopback); a "
                        "killed group starts again alone and heals from a live one (kinds: kill, stall)")
    p.add_argument("--restart-delay", type=float, default=2.0, help="--torchft: seconds before a failed group restarts")
    p.add_argument("--heartbeat-s", type=float, default=1.0,
                   help="--torchft: the Lighthouse's heartbeat timeout (how soon a lost group is dropped)")
    p.add_argument("--max-restarts", type=int, default=20)
    p.add_argument("--grace-s", type=float, default=10.0,
                   help="after a rank fails, how long the others may take to fail on their own (their errors are "
                        "recorded) before every rank is stopped and restarted")
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                   help="network namespaces (root): needed for link faults and --bandwidth")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each job's checkpoints (removed at its end)")
    p.add_argument("--reference", action="store_true", help="first run the job without faults, and compare")
    p.add_argument("--out", default="results/faults")
    p.add_argument("train", nargs=argparse.REMAINDER, help="-- then commhooks train's options")
    args = p.parse_args(argv)
    args.train = args.train[1:] if args.train[:1] == ["--"] else args.train
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        p.error(f"--kinds: {bad} not among {KINDS}")
    if args.ranks < 1 or args.nodes < 1 or args.ranks % args.nodes:
        p.error(f"--nodes {args.nodes} must divide --ranks {args.ranks} (both >= 1)")
    if args.mtbf <= 0:
        p.error("--mtbf must be > 0 seconds")
    if any(a.startswith(("--checkpoint-dir", "--json-out", "--resume", "--progress-file")) for a in args.train):
        p.error("the injector sets --checkpoint-dir, --json-out, --resume and --progress-file itself")
    if args.torchft:
        asked = [item.split(":")[1] for item in args.at.split(",") if item.count(":") >= 2] if args.at else kinds
        bad = [k for k in asked if k not in LiveInjector.LIVE_KINDS]
        if bad or args.netns == "on" or args.bandwidth != "unlimited":
            p.error(f"--torchft runs on loopback with kinds {LiveInjector.LIVE_KINDS} (torchft's heal transport names "
                    "hosts by hostname, which the network namespaces do not resolve)")
        args.netns = "off"
    elif not any(a.startswith(("--checkpoint-every", "--checkpoint-seconds")) for a in args.train):
        p.error("give commhooks train --checkpoint-every N or --checkpoint-seconds T after --: without checkpoints "
                "every restart starts over")
    try:
        args.faults = parse_at(args.at) if args.at else schedule(
            kinds, args.mtbf, args.horizon or 10 * args.mtbf, args.seed, args.ranks, args.nodes, args.stall_s,
            args.down_s)
    except ValueError as exc:
        p.error(str(exc))
    for f in args.faults:
        what = "nodes" if f.kind in ("kill-node",) + LINK_KINDS else "ranks"
        count = args.nodes if what == "nodes" else args.ranks
        if not 0 <= f.target < count:
            p.error(f"--at: {f.kind} {f.target}: its target is one of the {count} {what} (0 to {count - 1})")
    return args


def table(paths: List[str]) -> str:
    """A markdown table of recorded runs (``faults.json`` files): one row per run, then the mean of each numeric
    column."""
    rows, live = [], False
    for path in paths:
        report = json.loads(Path(path).read_text())
        f, ref = report["faulted"], report.get("reference") or {}
        live = "groups" in f  # (one kind of run per table)
        quality = "val_loss" if (f.get("summary") or {}).get("val_loss") is not None else "test_acc"
        kinds = ", ".join(sorted({x["kind"] for x in f["faults"]}))
        if live:
            got = statistics.mean(g[quality] for g in f["groups"])
            want = statistics.mean(g[quality] for g in ref.get("groups", [])) if ref else None
            same = "yes" if f["groups_identical"] else "NO"
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--table"]:  # commhooks faults --table results/<run>/seed*/faults.json
        print(table(argv[1:]))
        return 0
    args = parse_args(argv)
    out = Path(args.out)
    links = any(f.kind in LINK_KINDS for f in args.faults) or args.bandwidth != "unlimited"
    use_netns = args.netns == "on" or (args.netns == "auto" and os.geteuid() == 0)
    if links and not use_netns:
        print("commhooks faults: link faults and --bandwidth need network namespaces (root, --netns on)",
              file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: finally cleans up
    report = {"argv": sys.argv[1:], "faults_planned": [asdict(f) for f in args.faults]}
    lab = None
    try:
        if use_netns:
            for name in remove_stale_lab():
                print(f"[faults] removed a dead run's {name}", flush=True)
            lab = NetnsLab(args.ranks, nodes=args.nodes).__enter__()
            report["link"] = lab.shape(args.bandwidth, "0ms")
        if args.reference:
            report["reference"] = run_job(args, args.train, out / "reference", lab, [])
        report["faulted"] = run_job(args, args.train, out / "faulted", lab, args.faults)
    except (LabError, RuntimeError) as exc:
        print(f"commhooks faults: {exc}", file=sys.stderr)
        return 1
    finally:
        if lab is not None:
            lab.__exit__(None, None, None)
        out.mkdir(parents=True, exist_ok=True)
        (out / "faults.json").write_text(json.dumps(report, indent=2) + "\n")
    f, ref = report["faulted"], report.get("reference")
    print(f"[faults] {f['faults_injected']} fault(s), {len(f['restarts'])} restart(s), {f.get('steps_redone', 0)} "
          f"step(s) redone, wall {f['wall_s']:.1f}s" + (f" (fault-free {ref['wall_s']:.1f}s)" if ref else ""), flush=True)
    if "groups_identical" in f:
        print(f"[faults] the live groups ended {'bit-identical' if f['groups_identical'] else 'DIFFERENT'}; heals "
              f"{[g['heals'] for g in f['groups']]}, collectives retried {[g['retries'] for g in f['groups']]}",
              flush=True)
    elif ref and f["summary"] and ref["summary"]:
        same = f["summary"]["params_sha256"] == ref["summary"]["params_sha256"]
        print(f"[faults] final parameters {'bit-identical to' if same else 'DIFFER from'} the fault-free run", flush=True)
        return 0 if same else 1
    return 0 if f.get("groups_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
