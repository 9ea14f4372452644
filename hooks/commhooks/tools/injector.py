"""The injector's two ways of running a job with faults: every rank restarted from its checkpoints
(:class:`Injector`, torchelastic's way), or one replica group restarted alone to heal from the others
(:class:`.live_injector.LiveInjector`, torchft's way).  Each records what happened in ``record``;
:mod:`.fault_report` counts it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..launch import free_port
from .bench import NetnsLab, stop_workers
from .fault_schedule import LINK_KINDS, Fault

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

    def procs_of(self, fault: Fault) -> List[int]:
        """The processes (indices into an attempt's ``procs``) a kill or a stall of ``fault`` signals."""
        return self.ranks_of(fault.target) if fault.kind == "kill-node" else [fault.target]

    def alive(self, attempt: Attempt, fault: Fault) -> bool:
        """Whether the target of ``fault`` still runs."""
        return attempt.procs[fault.target].poll() is None

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
        if fault.kind in ("kill", "kill-node"):
            self._signal(attempt, self.procs_of(fault), signal.SIGKILL)
        elif fault.kind == "stall":
            self._signal(attempt, self.procs_of(fault), signal.SIGSTOP)
            self.undo.append((now + fault.duration_s, "cont", fault, attempt))
        elif fault.kind == "link-down":
            self._link(fault.target, "ip", "link", "set", "{dev}", "down")
            self.undo.append((now + fault.duration_s, "up", fault, attempt))
        elif fault.kind == "throttle":
            self._link(fault.target, "tc", "qdisc", "replace", "dev", "{dev}", "root", "tbf", "rate",
                       self.args.throttle_rate, "burst", "32kbit", "latency", "50ms")
            self.undo.append((now + fault.duration_s, "unthrottle", fault, attempt))
        self.record["faults"].append({**asdict(fault), "injected_s": round(now, 2)})
        print(f"[faults] {now:7.1f}s  {fault.kind} {self.target_name(fault)}"
              + (f" for {fault.duration_s:g}s" if fault.duration_s else "") + f" (step ~{fault.step})", flush=True)

    def target_name(self, fault: Fault) -> str:
        """What a fault hit, in the log: ``rank 3``, ``node 1``."""
        return f"{'node' if fault.kind in ('kill-node',) + LINK_KINDS else 'rank'} {fault.target}"

    def inject_due(self, pending: list, attempt, alive_only: bool = False) -> None:
        """One tick of the injection loop: the first fault due (in order, one per tick; with ``alive_only`` not
        into a process that already ended), the faults whose time is up undone, a 50 ms pause."""
        for fault in [f for f in pending if self.due(f)][:1]:
            pending.remove(fault)
            if not alive_only or self.alive(attempt, fault):
                self.inject(fault, attempt)
        self.undo_due()
        time.sleep(0.05)

    def undo_due(self, everything: bool = False) -> None:
        keep = []
        for due, action, fault, attempt in self.undo:
            if not everything and self.now() < due:
                keep.append((due, action, fault, attempt))
            elif action == "cont":
                self._signal(attempt, self.procs_of(fault), signal.SIGCONT)
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
                self.inject_due(pending, attempt)
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
            "errors": {r: last_error(log) for r, log in enumerate(attempt.logs)}})
        print(f"[faults] {when:7.1f}s  rank(s) {failed} failed; restarting every rank", flush=True)


def last_error(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if re.search(r"Error|error:|Killed|fault", ln)]
    return lines[-1].strip()[:400] if lines else ""


def _resumed_from(log: Path) -> Optional[int]:
    found = re.search(r"resumed from \S+ at step (\d+)", log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1)) if found else None
