"""``commhooks faults``: run a training job, inject faults on a seeded schedule, restart it, and count the cost.

    commhooks faults --ranks 4 --nodes 2 --mtbf 20 --kinds kill,stall,link-down --seed 0 --reference \\
        --out results/faults-run -- --config configs/qsr_mnist1d.json --steps 3000 --checkpoint-seconds 5
    commhooks faults --table results/faults-run/faults.json     # tables of recorded runs: faults that hit, by kind

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

``--torchft`` runs live replica groups instead (:mod:`.live_injector`): ``--ranks`` groups of ``--group-ranks``
processes each; a group that fails starts again alone and heals from a live one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

from .bench import LabError, NetnsLab, remove_stale_lab
from .fault_report import groups_identical, summarize, table, table_data
from .fault_schedule import KINDS, LINK_KINDS, Fault, parse_at, schedule
from .injector import Injector
from .live_injector import LiveInjector


def run_job(args, train_argv: List[str], out: Path, lab: Optional[NetnsLab], faults: List[Fault]) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # an earlier job's checkpoints would be resumed from
    out.mkdir(parents=True, exist_ok=True)
    injector = LiveInjector(args, train_argv, out, faults) if args.torchft else Injector(args, train_argv, out, lab, faults)
    record = injector.run()
    if args.torchft:  # every group's own summary: they must end identical
        keys = ("heals", "retries", "joined_at", "params_sha256", "test_acc", "val_loss", "syncs")
        size = args.group_ranks
        # each finished rank's summary, by global rank (group * group_ranks + rank); a group stopped at the end left
        # only a dead start's files, if any
        ranks = {i: json.loads((out / f"summary.rank{i}.json").read_text()) for i in range(args.ranks * size)
                 if (out / f"summary.rank{i}.json").exists() and i // size not in record.get("stopped_at_end", [])}
        groups = [ranks[i] for i in sorted(ranks) if i % size == 0]  # a group's summary: its rank 0's
        record["groups"] = [{k: s.get(k) for k in keys} for s in groups]
        if size > 1:  # every rank's: each rank of a group heals and retries through its own Manager
            record["ranks"] = [{"group": i // size, "rank": i % size, **{k: ranks[i].get(k) for k in keys}}
                               for i in sorted(ranks)]
        # the groups that finished (one killed near the end may still be rejoining when the others are done)
        record["groups_finished"] = len(groups)
        # None: under two finished, nothing to compare; with several ranks a group, every finished rank's model
        same = groups_identical(groups)
        record["groups_identical"] = same if size == 1 or same is None else groups_identical(list(ranks.values()))
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
                   help="live recovery: replica groups over torchft (--ranks groups of --group-ranks processes, "
                        "loopback); a killed group starts again alone and heals from a live one (kinds: kill, stall)")
    p.add_argument("--group-ranks", type=int, default=1,
                   help="--torchft: processes per replica group (their own process group, DDP inside it; rank i syncs "
                        "with rank i of the other groups); a kill or a stall hits one rank of the group, drawn from "
                        "--seed, and the whole group restarts")
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
    if args.group_ranks < 1:
        p.error(f"--group-ranks {args.group_ranks}: processes per replica group, >= 1")
    if args.group_ranks > 1 and not args.torchft:
        p.error(f"--group-ranks {args.group_ranks} is for --torchft (live replica groups); a restart run's ranks are "
                "--ranks, split over --nodes")
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--table"]:  # commhooks faults --table results/<run>/seed*/faults.json [--json FILE]
        paths, out = (argv[1:-2], argv[-1]) if argv[-2:-1] == ["--json"] else (argv[1:], None)
        print(table(paths))
        if out is not None:  # the same figures as data, for the docs' claims
            Path(out).write_text(json.dumps(table_data(paths), indent=1) + "\n")
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
        ended = {True: "bit-identical", False: "DIFFERENT", None: f"with {f['groups_finished']} group(s) finished: "
                 "nothing to compare"}[f["groups_identical"]]
        each = f.get("ranks", f["groups"])  # with several ranks a group: by global rank
        print(f"[faults] the live groups ended {ended}; heals {[g['heals'] for g in each]}, collectives retried "
              f"{[g['retries'] for g in each]}" + (" (by global rank)" if "ranks" in f else ""), flush=True)
    elif ref and f["summary"] and ref["summary"]:
        same = f["summary"]["params_sha256"] == ref["summary"]["params_sha256"]
        print(f"[faults] final parameters {'bit-identical to' if same else 'DIFFER from'} the fault-free run", flush=True)
        return 0 if same else 1
    return 1 if f.get("groups_identical") is False else 0


if __name__ == "__main__":
    sys.exit(main())
