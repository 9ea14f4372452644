"""``commhooks faults --torchft``: replica groups over torchft, each started on its own, a Lighthouse in this
process; a group that fails is started again alone (after ``--restart-delay``) and heals from a live one: no one
else stops.

A group is one process (``--group-ranks 1``: ``RANK`` / ``WORLD_SIZE`` are the group's index and the number of
groups) or several (``--group-ranks K``: the group's ranks started together with a rendezvous of their own,
``MASTER_ADDR`` / ``MASTER_PORT`` a fresh free port at each start, ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE`` inside the group, and the group's index and the number of groups in the variables
:mod:`.live` reads).  A ``kill`` or a ``stall`` of a group signals one of its ranks, drawn from ``--seed`` and
recorded as the fault's ``rank``.  A group with a rank dead has failed: its other ranks are stopped, the failure
is recorded, and the whole group starts again.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from dataclasses import asdict
from typing import List, Optional

from ..launch import free_port
from .bench import stop_workers
from .fault_schedule import Fault
from .injector import Attempt, Injector, last_error
from .live import GROUP_VAR, GROUPS_VAR

LAUNCHER_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "COMMHOOKS_WIRE_IFACE",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


class LiveInjector(Injector):
    """``--torchft``: ``--ranks`` replica groups of ``--group-ranks`` processes; an attempt's ``procs`` and
    ``logs`` are indexed by global rank ``group * group_ranks + rank``."""

    LIVE_KINDS = ("kill", "stall")

    def __init__(self, args, train_argv, out, faults):
        super().__init__(args, train_argv, out, None, faults)
        from torchft.coordination import LighthouseServer

        self.size = args.group_ranks
        self.pick = random.Random(args.seed)  # which rank of a group each fault hits
        self.victims = {}  # id(fault) -> the rank of its group it hit
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000,
                                           heartbeat_timeout_ms=int(1000 * args.heartbeat_s))

    @property
    def per_node(self) -> int:
        return 1  # no nodes: a fault's target is a group

    def members(self, g: int) -> range:
        return range(g * self.size, (g + 1) * self.size)

    def procs_of(self, fault: Fault) -> List[int]:
        return [fault.target * self.size + self.victims.get(id(fault), 0)]

    def alive(self, attempt: Attempt, fault: Fault) -> bool:
        return all(attempt.procs[i].poll() is None for i in self.members(fault.target))

    def inject(self, fault: Fault, attempt: Attempt) -> None:
        if self.size > 1:
            self.victims[id(fault)] = self.pick.randrange(self.size)
        super().inject(fault, attempt)
        if self.size > 1:
            self.record["faults"][-1]["rank"] = self.victims[id(fault)]

    def target_name(self, fault: Fault) -> str:
        return f"group {fault.target}" + (f" (its rank {self.victims[id(fault)]})" if self.size > 1 else "")

    def start_group(self, attempt: Attempt, g: int) -> None:
        port = free_port("127.0.0.1") if self.size > 1 else None  # fresh at each start: no dead start's keys
        for r, i in enumerate(self.members(g)):
            if self.size == 1:
                env = dict(os.environ, RANK=str(g), WORLD_SIZE=str(self.args.ranks), OMP_NUM_THREADS="1")
                log = self.out / f"group{g}.start{attempt.index}.log"
            else:
                env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
                env.update(RANK=str(r), WORLD_SIZE=str(self.size), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(self.size),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                           **{GROUP_VAR: str(g), GROUPS_VAR: str(self.args.ranks)})
                log = self.out / f"group{g}.rank{r}.start{attempt.index}.log"
            cmd = [sys.executable, "-m", "commhooks.tools.train", *self.train_argv, "--no-progress", "--backend",
                   "torchft", "--lighthouse", self.lighthouse.address(), "--progress-file", str(self.progress),
                   "--json-out", str(self.out / "summary.rank{rank}.json")]
            with open(log, "w") as f:
                attempt.procs[i] = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                                    start_new_session=True)
            attempt.logs[i] = log

    def group_code(self, attempt: Attempt, g: int) -> Optional[int]:
        """A failed rank's exit code if any rank failed, 0 once every rank ended well, else None."""
        codes = [attempt.procs[i].poll() for i in self.members(g)]
        failed = [c for c in codes if c not in (None, 0)]
        return failed[0] if failed else 0 if all(c == 0 for c in codes) else None

    def fail_group(self, attempt: Attempt, g: int, code: int) -> None:
        """Record a group's failure; with several ranks, stop the ones still running (the group restarts whole)."""
        procs, logs = [attempt.procs[i] for i in self.members(g)], [attempt.logs[i] for i in self.members(g)]
        failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
        failure = {"group": g, "at_s": round(self.now(), 2), "exit": code, "step": self.step(),
                   "error": last_error(logs[failed[0]])}
        if self.size > 1:
            stop_workers(procs)
            failure.update(failed_ranks=failed, exits={r: p.returncode for r, p in enumerate(procs)},
                           errors={r: last_error(log) for r, log in enumerate(logs)})
        self.record["failures"].append(failure)
        print(f"[faults] {self.now():7.1f}s  group {g} " + (f"rank(s) {failed} " if self.size > 1 else "")
              + f"exited ({code})" + ("; its other ranks stopped" if self.size > 1 else "") + "; it starts again "
              f"in {self.args.restart_delay:g}s and heals from a live group", flush=True)

    def run(self) -> dict:
        pending, restarts = list(self.faults), []  # (due_s, group)
        every = self.args.ranks * self.size
        attempt = Attempt(0, 0.0, [None] * every, [None] * every)
        self.exited = {}
        for g in range(self.args.ranks):
            self.start_group(attempt, g)
        ending = None  # once a group has finished: the others get --grace-s to finish too (a restart is off)
        try:
            while True:
                codes = [self.group_code(attempt, g) for g in range(self.args.ranks)]
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
                        self.fail_group(attempt, g, code)
                        if len(self.record["failures"]) > self.args.max_restarts:
                            raise RuntimeError(f"gave up after {self.args.max_restarts} restarts")
                        restarts.append((self.now() + self.args.restart_delay, g))
                for due, g in [r for r in restarts if r[0] <= self.now()]:
                    restarts.remove((due, g))
                    attempt.index += 1
                    self.start_group(attempt, g)
                    logs = [attempt.logs[i].name for i in self.members(g)]
                    # the wall clock too: heal times come from the timestamps of torchft's lines in the logs
                    self.record["restarts"].append({"group": g, "at_s": round(self.now(), 2),
                                                    "at_unix": round(time.time(), 3), "log": logs[0],
                                                    **({"logs": logs} if self.size > 1 else {})})
                self.inject_due(pending, attempt, alive_only=True)
        finally:
            stop_workers(attempt.procs)
            self.undo_due(everything=True)
            self.lighthouse.shutdown()
        self.record["not_injected"] = [asdict(f) for f in pending]
        return self.record
