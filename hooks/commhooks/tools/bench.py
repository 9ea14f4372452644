"""``commhooks bench``: every method side by side on a constrained network.

    commhooks bench                          # all methods, 2 ranks, 1200 steps, unlimited / 1 Gbit/s / 100 Mbit/s
    commhooks bench --quick                  # 20 steps, loopback, one bandwidth: a smoke test

Each rank runs in its own network namespace, the namespaces joined by veth
pairs on a bridge (iproute2; made by the run, removed after), so every byte a
method sends crosses a real link: the kernel's tx counters of each rank's veth
give the bytes on the wire for torch's hooks and ours alike, and ``tc``
(netem delay + tbf rate) on each veth makes the link slow.  Every method runs
the same model, seed, data order and number of optimizer steps through
``commhooks.tools.train`` (the workers).  Quality and time are measured apart
(docs/pages/tools/measure.md): the quality column comes from full runs on an unlimited link,
one per seed (the link changes only the time); the time comes from ``--repeats``
interleaved runs at each link setting (``--time-steps``: only the schedule's
first steps), each timed after its first tenth, each method's run between two
compute-only runs and divided by their geometric mean, DDP's repeat k by the
method's (``timing.py``).  Without root (or where
namespaces cannot be made) the run says so and falls back to loopback with
payload bytes only.

Output in ``--out``: ``results.json``, ``table.md``, ``accuracy_vs_bytes.png``,
``time_vs_bandwidth.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..launch import free_port
from ..shipped import shipped_configs
from . import provenance, timing
from .anchors import ANCHORS
from .workloads import WORKLOADS

METHODS: Dict[str, List[str]] = {
    "ddp": ["--hook", "none"],
    "fp16": ["--hook", "fp16"],
    "powersgd-r1": ["--hook", "powersgd", "--powersgd-rank", "1"],
    "powersgd-r4": ["--hook", "powersgd", "--powersgd-rank", "4"],
    "local-sgd-h8": ["--hook", "local-sgd", "--local-sgd-period", "8"],
    # commhooks' methods: a config file each (its "type" picks the algorithm)
    "qsr": ["--config", "configs/qsr_mnist1d.json"],
    "ab-groups": ["--config", "configs/ab_mnist1d.json"],
    # the authors' first phase: untruncated factors until the first re-basis (first_rank "full"; ours: "cut")
    "ab-groups-full": ["--config", "configs/ab_full_mnist1d.json"],
    "ab-groups-short": ["--config", "configs/ab_short_mnist1d.json"],  # warm-up 100, F 5
    "ab-only-b": ["--config", "configs/ab_onlyb_mnist1d.json"],
    "ab-x-qsr": ["--config", "configs/abqsr_mnist1d.json"],
    "ab-x-qsr-int8": ["--config", "configs/abqsr_int8_mnist1d.json"],  # its syncs send int8 changes
    "qsr-int8": ["--config", "configs/qsr_int8_mnist1d.json"],  # int8 pseudo-gradient + error feedback
    "diloco-h20": ["--config", "configs/diloco_mnist1d.json"],  # DiLoCo's anchor: fixed period, Nesterov outer step
    "qsr-diloco-int8": ["--config", "configs/qsr_diloco_int8_mnist1d.json"],  # QSR periods, outer step, int8
    # the same in fp32; with fewer bits: int4 (block 128), int2 (ternary, block 64, stochastic rounding; and to
    # nearest), top-k (2 % of each chunk, int4 values), all with error feedback; and with the period-aware outer step
    "qsr-diloco": ["--config", "configs/qsr_diloco_mnist1d.json"],
    "qsr-diloco-int4": ["--config", "configs/qsr_diloco_int4_mnist1d.json"],
    "qsr-diloco-int2": ["--config", "configs/qsr_diloco_int2_mnist1d.json"],
    "qsr-diloco-int2-nearest": ["--config", "configs/qsr_diloco_int2_nearest_mnist1d.json"],
    "qsr-diloco-topk": ["--config", "configs/qsr_diloco_topk_mnist1d.json"],
    "qsr-diloco-int8-lrsum": ["--config", "configs/qsr_diloco_int8_lrsum_mnist1d.json"],
    "qsr-diloco-int4-lrsum": ["--config", "configs/qsr_diloco_int4_lrsum_mnist1d.json"],
    # int4 averaged by one allgather whatever the world (the default, auto, takes the two-step exchange from 3 ranks)
    "qsr-diloco-int4-allgather": ["--config", "configs/qsr_diloco_int4_allgather_mnist1d.json"],
    # int2 to nearest with one scale per 256 elements; and with QSR's alpha raised (periods (a/0.01)^2 as long); fp32 too
    "qsr-diloco-int2-b256": ["--config", "configs/qsr_diloco_int2_b256_mnist1d.json"],
    "qsr-diloco-int2-a0125": ["--config", "configs/qsr_diloco_int2_a0125_mnist1d.json"],  # alpha 0.0125, 0.015, 0.02
    "qsr-diloco-int2-a015": ["--config", "configs/qsr_diloco_int2_a015_mnist1d.json"],
    "qsr-diloco-int2-a02": ["--config", "configs/qsr_diloco_int2_a02_mnist1d.json"],
    "qsr-diloco-a02": ["--config", "configs/qsr_diloco_a02_mnist1d.json"],
    # the same, each sync landing 2 local steps after it is sent (Streaming DiLoCo's overlap)
    "qsr-diloco-int8-overlap": ["--config", "configs/qsr_diloco_int8_overlap_mnist1d.json"],
    # the same without the outer step: plain averaging of int8 changes, landing 2 steps after they are sent
    "qsr-int8-overlap": ["--config", "configs/qsr_int8_overlap_mnist1d.json"],
    # QSR's comparison rules (arXiv 2310.14423): a constant period h_base, and H ~ 1/lr with at least QSR's syncs
    "qsr-constant": ["--config", "configs/qsr_constant_mnist1d.json"],
    "qsr-power1": ["--config", "configs/qsr_power1_mnist1d.json"],
    # replica groups of a node's ranks that each sync their part across nodes (qsr.hierarchical), int8 changes
    "qsr-int8-hier": ["--config", "configs/qsr_int8_hier_mnist1d.json"],
    "qsr-int4-hier": ["--config", "configs/qsr_int4_hier_mnist1d.json"],  # the same in int4, and in int2 (nearest)
    "qsr-int2-hier": ["--config", "configs/qsr_int2_hier_mnist1d.json"],
    # the same in fp32 and as top-k (2 % of each 4096-element chunk, int4 values); and with the DiLoCo outer step
    # (Nesterov 0.9, outer lr 0.7) on int8, plain and period-aware (outer_normalize lr_sum)
    "qsr-hier": ["--config", "configs/qsr_hier_mnist1d.json"],
    "qsr-topk-hier": ["--config", "configs/qsr_topk_hier_mnist1d.json"],
    "qsr-diloco-int8-hier": ["--config", "configs/qsr_diloco_int8_hier_mnist1d.json"],
    "qsr-diloco-int8-hier-lrsum": ["--config", "configs/qsr_diloco_int8_hier_lrsum_mnist1d.json"],
    # the same with a constant period of 2 (alpha 0): more syncs, closer to DDP; and each sync landing a step later
    "local-h2-int8-hier": ["--config", "configs/local_h2_int8_hier_mnist1d.json"],
    "local-h2-int8-hier-overlap": ["--config", "configs/local_h2_int8_hier_overlap_mnist1d.json"],
    "local-h2-int2-hier": ["--config", "configs/local_h2_int2_hier_mnist1d.json"],  # period 2 in int2 (nearest)
    "local-h3-int2-hier": ["--config", "configs/local_h3_int2_hier_mnist1d.json"],  # and period 3
    "local-h4-int2-hier": ["--config", "configs/local_h4_int2_hier_mnist1d.json"],  # and 4
    "qsr-diloco-int2-overlap": ["--config", "configs/qsr_diloco_int2_overlap_mnist1d.json"],  # a0125, 1 step of
    "qsr-diloco-int2-overlap2": ["--config", "configs/qsr_diloco_int2_overlap2_mnist1d.json"],  # overlap; and 2
    "qsr-sparseloco-d2": ["--config", "configs/qsr_sparseloco_d2_mnist1d.json"],  # top-k 2 % / 3 %, int2 values, the
    "qsr-sparseloco-d3": ["--config", "configs/qsr_sparseloco_d3_mnist1d.json"],  # residual decayed (0.95) as momentum
    "qsr-sparseloco-d2-a008": ["--config", "configs/qsr_sparseloco_d2_a008_mnist1d.json"],  # the same at alpha 0.008,
    "qsr-sparseloco-d2-lr2": ["--config", "configs/qsr_sparseloco_d2_lr2_mnist1d.json"],  # at outer lr 2
    "qsr-sparseloco-d2-lr2-overlap2": ["--config", "configs/qsr_sparseloco_d2_lr2_overlap2_mnist1d.json"],  # + overlap
    "qsr-nosync": ["--config", "configs/qsr_nosync_mnist1d.json"],  # syncs switched off: commhooks' per-step floor
    # the peers by their own code (tools/peers.py): torchft's LocalSGD and DiLoCo at commhooks' period of 4 (the
    # outer step: SGD lr 0.7, Nesterov 0.9, the paper's), and Streaming DiLoCo (2 fragments, a step of delay, half
    # mixing); fp32 (torchft's quantized path needs a GPU); loopback only (--netns off)
    "torchft-localsgd-h4": ["--hook", "torchft-localsgd", "--peer-sync-every", "4"],
    "torchft-diloco-h4": ["--hook", "torchft-diloco", "--peer-sync-every", "4"],
    "torchft-streaming-h4": ["--hook", "torchft-diloco", "--peer-sync-every", "4", "--peer-fragments", "2",
                             "--peer-delay", "1", "--peer-alpha", "0.5"],
    # the floors a method cannot go below on its set-up (FLOORS): its hooks with no sync, and with replica groups
    # also their in-node gradient mean every step, nothing across the nodes (both end with one sync: the run's last)
    "floor-hooks": ["--config", "configs/floor_hooks_mnist1d.json"],
    "floor-in-node": ["--config", "configs/floor_in_node_mnist1d.json"],
    "compute-only": ["--hook", "compute-only"],
}
DEFAULT_REPEATS = 15  # docs/pages/tools/measure.md: why 15, and what 9 and 25 gave: results/bench-protocol-mnist1d-2026-12-06
CONTROLS = ("qsr-nosync", "floor-hooks", "floor-in-node")  # methods that measure a floor, never one to choose (the planner's list leaves them out)
BANDWIDTHS = ("unlimited", "1gbit", "100mbit")


def method_argv(name: str, model: str, engine: str = "ddp", configs: Optional[Dict[str, str]] = None) -> List[str]:
    """The trainer's arguments for ``name``: a method's config ``configs/<x>_mnist1d.json`` becomes the
    workload's own ``configs/<x>_<suffix>.json`` where one exists (``--model gpt``: ``_gpt``).  ``engine``
    ``fsdp``: every method but PyTorch's own DDP hooks (compute-only among them) runs on FSDP2 sharded over a
    node's ranks; ``ddp`` (no hook) is then FSDP2's own HSDP, an all-reduce across the nodes every step.
    ``configs``: methods given as ``label=file.json`` (:func:`split_methods`), run from that file as it is."""
    if configs and name in configs:
        return ["--config", configs[name]] + (["--backend", engine] if engine != "ddp" else [])
    argv = list(METHODS[name])
    if engine != "ddp" and not (argv[:1] == ["--hook"] and argv[1] in ANCHORS):
        argv += ["--backend", engine]
    if "--config" in argv:
        i = argv.index("--config") + 1
        own = argv[i].replace("_mnist1d.json", f"_{WORKLOADS[model].config_suffix}.json")
        if Path(own).exists():
            argv[i] = own
    return argv


def method_source(name: str, model: str = "cnn") -> Dict[str, object]:
    """What declares method ``name``'s traffic (``commhooks plan`` asks, so that it names no method):
    ``{"config": path}`` for commhooks' methods (the registered algorithm declares it), else the trainer's
    ``{"hook": ..., "powersgd_rank": r, "local_period": h}`` (:mod:`.anchor_traffic`)."""
    if name not in METHODS:
        raise KeyError(f"no benchmark method {name!r}; known: {', '.join(METHODS)}")
    argv = list(METHODS[name])
    opts = dict(zip(argv[::2], argv[1::2]))
    if "--config" in opts:
        own = opts["--config"].replace("_mnist1d.json", f"_{WORKLOADS[model].config_suffix}.json") if (
            model in WORKLOADS) else opts["--config"]
        return {"config": own if Path(own).exists() or Path(own).stem in shipped_configs() else opts["--config"]}
    return {"hook": opts["--hook"], "powersgd_rank": int(opts.get("--powersgd-rank", 4)),
            "local_period": int(opts.get("--local-sgd-period", 8))}


def split_methods(entries: Sequence[str]) -> Tuple[List[str], Dict[str, str]]:
    """``--methods`` entries: a name from :data:`METHODS`, or ``label=path/to/config.json`` (a config of one's
    own, e.g. one point of a sweep: ``commhooks curves`` writes them) -> (labels in order, label -> file).
    Raises ValueError naming the entry that is neither."""
    names, configs = [], {}
    for entry in entries:
        label, sep, path = entry.partition("=")
        if not sep:
            if entry not in METHODS:
                raise ValueError(f"unknown method {entry!r}; choose from {', '.join(METHODS)}, or give "
                                 "label=path/to/config.json")
            names.append(entry)
            continue
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", label) or label in METHODS:
            raise ValueError(f"method label {label!r} (in {entry!r}) must be letters, digits, '_', '.', '+' or '-' "
                             "and not a built-in method's name")
        if not path.endswith(".json") or not Path(path).is_file():
            raise ValueError(f"method {label!r}: {path!r} is not a JSON config file")
        names.append(label)
        configs[label] = path
    if len(set(names)) != len(names):
        raise ValueError(f"--methods lists a method twice: {names}")
    return names, configs


class LabError(RuntimeError):
    """The network namespaces or tc could not be set up."""


def _sh(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


PREFIX = "chb"  # chb<pid of the benchmark>-hub, -r0, ...; veth<r>chb<pid>, chb<pid>h<r> while being moved


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_lab() -> List[str]:
    """Namespaces and veths left by a benchmark whose process no longer exists (never a live run's)."""
    removed = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name in names:
        m = re.fullmatch(PREFIX + r"(\d+)-(hub|r\d+)", name)
        if m and not _alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for name in re.findall(r"^\d+: ([^:@\s]+)", links, flags=re.M):
        m = re.fullmatch(r"veth\d+" + PREFIX + r"(\d+)|" + PREFIX + r"(\d+)h\d+", name)
        if m and not _alive(int(m.group(1) or m.group(2))):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
            removed.append(name)
    return removed


class NetnsLab:
    """N *node* namespaces with a veth each to a bridge in a hub namespace; 10.77.0.(k+1)/24 inside only.

    The ranks of a node run in its namespace, so they reach each other over that namespace's own addresses
    (the kernel delivers those locally: fast, unlimited) and share its one veth to the bridge (rate-limited
    by tc): a node's ranks share its link, as on a cluster.  ``nodes`` defaults to one rank per node.
    Names carry the benchmark's pid, so a later run can tell a dead run's leftovers from a live run's.
    """

    def __init__(self, ranks: int, prefix: Optional[str] = None, nodes: Optional[int] = None):
        self.ranks = ranks
        self.nodes = nodes or ranks
        if self.ranks % self.nodes:
            raise LabError(f"--nodes {self.nodes} must divide --ranks {self.ranks}")
        self.per_node = self.ranks // self.nodes
        self.prefix = prefix or f"{PREFIX}{os.getpid()}"
        self.hub = f"{self.prefix}-hub"
        self.made: List[str] = []

    def node(self, r: int) -> int:
        """The node of rank ``r`` (contiguous blocks, as launchers place ranks)."""
        return r // self.per_node

    def ns(self, r: int) -> str:
        return f"{self.prefix}-r{self.node(r) * self.per_node}" if self.per_node > 1 else f"{self.prefix}-r{r}"

    def iface(self, r: int) -> str:
        return f"veth{self.node(r)}"

    def addr(self, r: int) -> str:
        return f"10.77.0.{self.node(r) + 1}"

    def __enter__(self):
        try:
            if shutil.which("ip") is None or shutil.which("tc") is None:
                raise LabError("iproute2 (ip, tc) is not installed")
            _sh("ip", "netns", "add", self.hub)
            self.made.append(self.hub)
            _sh("ip", "netns", "exec", self.hub, "ip", "link", "add", "br0", "type", "bridge")
            _sh("ip", "netns", "exec", self.hub, "ip", "link", "set", "br0", "up")
            for r in range(0, self.ranks, self.per_node):  # the first rank of each node names it
                ns, peer = self.ns(r), f"{self.prefix}h{self.node(r)}"
                _sh("ip", "netns", "add", ns)
                self.made.append(ns)
                _sh("ip", "link", "add", self.iface(r) + self.prefix, "type", "veth", "peer", "name", peer)
                _sh("ip", "link", "set", self.iface(r) + self.prefix, "netns", ns)
                _sh("ip", "link", "set", peer, "netns", self.hub)
                inside = ("ip", "netns", "exec", ns)
                _sh(*inside, "ip", "link", "set", self.iface(r) + self.prefix, "name", self.iface(r))
                _sh(*inside, "ip", "addr", "add", f"{self.addr(r)}/24", "dev", self.iface(r))
                _sh(*inside, "ip", "link", "set", self.iface(r), "up")
                _sh(*inside, "ip", "link", "set", "lo", "up")
                _sh("ip", "netns", "exec", self.hub, "ip", "link", "set", peer, "master", "br0")
                _sh("ip", "netns", "exec", self.hub, "ip", "link", "set", peer, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for ns in reversed(self.made):  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []
        return False

    def shape(self, bandwidth: str, delay: str) -> str:
        """Limit every rank's egress: netem delay (where the kernel has it) under a tbf rate.

        Returns what was applied, e.g. ``"tbf 100mbit + netem 1ms"``, ``"tbf 100mbit (no netem in this
        kernel)"`` or ``"none"`` for ``unlimited``.
        """
        applied = "none"
        for r in range(0, self.ranks, self.per_node):  # one link per node
            inside = ("ip", "netns", "exec", self.ns(r), "tc")
            subprocess.run([*inside, "qdisc", "del", "dev", self.iface(r), "root"], capture_output=True)
            if bandwidth == "unlimited":
                continue
            tbf = ("tbf", "rate", bandwidth, "burst", "32kbit", "latency", "50ms")
            try:
                _sh(*inside, "qdisc", "add", "dev", self.iface(r), "root", "handle", "1:", "netem", "delay", delay)
                _sh(*inside, "qdisc", "add", "dev", self.iface(r), "parent", "1:1", "handle", "10:", *tbf)
                applied = f"tbf {bandwidth} + netem {delay}"
            except LabError as exc:
                if "unknown" not in str(exc).lower():
                    raise
                subprocess.run([*inside, "qdisc", "del", "dev", self.iface(r), "root"], capture_output=True)
                _sh(*inside, "qdisc", "add", "dev", self.iface(r), "root", *tbf)
                applied = f"tbf {bandwidth} (no netem in this kernel: no added delay)"
        return applied


def run_bandwidth(methods: Sequence[str], args, lab: Optional[NetnsLab], out: Path, timeout: float,
                  seed: Optional[int] = None, repeats: Optional[int] = None,
                  stop_after: Optional[int] = None, resume: bool = False) -> Dict[str, List[dict]]:
    """All methods at one link setting, one after the other, in one process group: per method, the per-rank
    summaries (``stop_after``: only the schedule's first steps, a timing window).  Each finished stage leaves
    ``done.json`` in ``out`` (its spec, commit and machine load); ``resume`` reuses such a stage instead of
    running it again (``finished_stage``)."""
    seed = args.seeds[0] if seed is None else seed
    out.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(args.steps), "--model", args.model, "--seed", str(seed), "--no-progress"]
    whole = set(getattr(args, "whole_schedule", ()))  # timed over the whole schedule, whatever stop_after says
    window = {name: [] if stop_after is None or stop_after >= args.steps or name in whole else
              ["--stop-after", str(stop_after)] for name in methods}
    repeats = getattr(args, "repeats", 1) if repeats is None else repeats
    order = timing.bracketed_order(methods, repeats)  # repeats interleaved, each method between two floor runs
    label = {(name, k): name if k == 0 else f"{name}#{k}" for name, k in order}
    runs_of = {name: [label[(n, k)] for n, k in sorted(o for o in order if o[0] == name)] for name in methods}
    configs = getattr(args, "method_configs", {})
    spec = {label[(name, k)]: method_argv(name, args.model, getattr(args, "engine", "ddp"), configs) + common +
            window[name] + ["--label", name, "--json-out", str(out / f"{label[(name, k)]}.rank{{rank}}.json")]
            for name, k in order}
    if not (resume and finished_stage(out, spec)):
        launch_stage(spec, args, lab, out, timeout)
    sys.stdout.write((out / "worker-rank0.log").read_text())
    found = {}
    for name in methods:  # the first run's summary; per rank, each repeat's steady-state step time, in run order
        ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(args.ranks)]
        for r, summary in enumerate(ranks):
            times = [steady(json.loads((out / f"{run}.rank{r}.json").read_text())) for run in runs_of[name]]
            summary["step_ms_repeats"], summary["step_ms"] = times, statistics.median(times)
        found[name] = ranks
    return found


def finished_stage(out: Path, spec: dict) -> bool:
    """Whether ``out`` holds a finished stage of exactly this spec, run at this commit: a long run (the GPT
    headline: some four hours on 2 cores) can then stop and go on with ``--resume`` without mixing commits
    (docs/pages/tools/measure.md: one run, one commit).  A stage of another spec is run again; one of another commit, or
    from a checkout with uncommitted changes, is an error rather than a silent mix."""
    done = out / "done.json"
    if not done.exists():
        return False
    record = json.loads(done.read_text())
    if record.get("spec") != spec:
        return False
    here = provenance.commit()
    if here["dirty"] or record.get("dirty") or not here["commit"] or record.get("commit") != here["commit"]:
        was = provenance.describe(record.get("commit"), record.get("dirty"))
        now = provenance.describe(here["commit"], here["dirty"])
        raise RuntimeError(f"--resume: {out} was run at {was}, this is {now}; a run resumes only at the clean commit "
                           f"it started from (move {out} away to run it again)")
    print(f"[bench] {out.name}: finished earlier at this commit, reused (--resume)", flush=True)
    return True


def launch_stage(spec: dict, args, lab: Optional[NetnsLab], out: Path, timeout: float) -> None:
    """Run a stage's spec on ``args.ranks`` workers and wait for them; on success write ``done.json``."""
    (out / "done.json").unlink(missing_ok=True)
    before = cpu_clock()
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port("127.0.0.1")
    procs, logs = [], []
    for r in range(args.ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.ranks), MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   COMMHOOKS_CACHE=str(Path(args.cache_dir).resolve()))
        for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "COMMHOOKS_WIRE_IFACE"):
            env.pop(k, None)
        if pinned(args):  # one core a rank: the spread between ranks of a method that never waits shrinks
            env["COMMHOOKS_BENCH_CORE"] = str(r)
        cmd = [sys.executable, "-m", "commhooks.tools.bench", "--worker", str(spec_file)]
        if lab:
            env.update(MASTER_ADDR=lab.addr(0), LOCAL_RANK=str(r % lab.per_node), LOCAL_WORLD_SIZE=str(lab.per_node),
                       GLOO_SOCKET_IFNAME=lab.iface(r), COMMHOOKS_WIRE_IFACE=lab.iface(r))
            cmd = ["ip", "netns", "exec", lab.ns(r), *cmd]
        else:
            # loopback: --nodes still sets the node size (the groups), by default one rank per node as with the
            # namespaces (it was the whole world: a config's group_size null then made every rank one replica group)
            per_node = args.ranks // (args.nodes or args.ranks)
            env.update(MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(r % per_node), LOCAL_WORLD_SIZE=str(per_node))
        log = out / f"worker-rank{r}.log"
        logs.append(log)
        with open(log, "w") as f:  # each worker leads its own process group: ended as a whole below
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:  # a dead rank leaves the others waiting in a collective: do not wait for them
                raise RuntimeError(f"rank(s) {failed} failed:\n" + "\n".join(logs[r].read_text()[-3000:] for r in failed))
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ranks did not finish within {timeout:.0f} s")
            time.sleep(0.2)
        if any(p.returncode for p in procs):
            raise RuntimeError("a rank failed:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    finally:
        stop_workers(procs)
    (out / "done.json").write_text(json.dumps({"spec": spec, **provenance.commit(), "finished": time.strftime(
        "%Y-%m-%d %H:%M:%S"), "load": machine_load(before, cpu_clock())}, indent=1) + "\n")


def steady(summary: dict) -> float:
    """A run's step time in its steady-state window (after the first tenth of its steps), else over the run."""
    return summary.get("steady_step_ms") or summary["step_ms"]


def pinned(args) -> bool:
    """Each rank pinned to a core of its own: on unless --pin off, where the ranks fit on the cores."""
    return args.pin != "off" and args.ranks <= (os.cpu_count() or 1)


def stop_workers(procs) -> None:
    """End every worker's process group (SIGTERM, then SIGKILL after 3 s)."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while any(p.poll() is None for p in alive) and time.monotonic() < end:
            time.sleep(0.05)


def _terminate(signum, frame):
    """SIGTERM (timeout, kill, a scheduler's cancel) unwinds like Ctrl-C, so every finally cleans up."""
    raise SystemExit(128 + signum)


def worker(spec_file: str) -> int:
    """One rank: start once, train every method of the spec in turn."""
    from . import train

    spec = json.loads(Path(spec_file).read_text())
    core = os.environ.get("COMMHOOKS_BENCH_CORE")
    if core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(core)})
    first = train.parse_args(next(iter(spec.values())))
    rank, world, mean_over_ranks, finish = train.start(first)
    for name, argv in spec.items():
        t0 = time.perf_counter()
        margs = train.parse_args(argv)
        s = train.train_once(margs, rank, world, mean_over_ranks)
        if rank == 0:
            print(f"[bench] {name:<15}: {train.quality(s)}  {s['step_ms']:8.2f} ms/step  "
                  f"payload {s['payload_bytes_per_rank'] / 1e6:8.2f} MB  ({time.perf_counter() - t0:.0f} s)", flush=True)
    finish()
    return 0


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(first: List[dict], timed: Dict[str, List[dict]], per_node: int = 1,
              cores: Optional[int] = None) -> dict:
    """One method's row: quality and bytes from its full run of the first seed (``first``: per rank), its pace
    per repeat at each link setting from the timing runs (``timed``).

    With several ranks per node, each rank reads its node's shared link counter: the node's bytes are the
    mean of those readings, a rank's share that over ``per_node``."""
    by_rank = {bw: [r["step_ms_repeats"] for r in rs] for bw, rs in timed.items()}
    clock = next(iter(timed.values()), [])  # a timing run's ranks: its window's bytes (the same at every link)
    paces, rule = read_paces(by_rank, timing.never_waits(first), len(first), cores)
    wire = [r["wire_bytes_per_rank"] for r in first]
    node_tx = None if wire[0] is None else mean([w["tx"] for w in wire])
    across = mean([cross_node_payload(r.get("payload_bytes_by_group"), per_node) for r in first]) if per_node > 1 else None
    return {
        "cross_node_payload_bytes_per_rank": across,
        "wire_tx_bytes_per_node": node_tx if per_node > 1 else None,
        "test_acc": first[0]["test_acc"],
        "val_loss": first[0].get("val_loss"),  # --model gpt
        "val_ppl": first[0].get("val_ppl"),
        "train_loss": first[0]["train_loss"],
        "payload_bytes_per_rank": mean([r["payload_bytes_per_rank"] for r in first]),
        "meter_bytes_per_rank": mean([r["bytes_per_rank"] for r in first]),
        "wire_tx_bytes_per_rank": None if node_tx is None else node_tx / per_node,
        # per repeat the pace (timing.py: the ranks' mean where they never wait and each has a core, else the
        # slowest rank); the median
        "step_ms": {bw: statistics.median(p) for bw, p in paces.items()},
        "step_ms_paces": paces,
        "step_ms_repeats_by_rank": by_rank,
        "pace": rule,
        "syncs": first[0].get("syncs"),
        # the timed window (steps a..b, from 1) and what the method sent in those same steps: the time ratios
        # divide the time of these steps, so the bytes beside them are these steps' (whole-run totals above)
        "timed_window": clock[0].get("window") if clock else None,
        "window_payload_bytes_per_rank": mean([r.get("window_payload_bytes_per_rank") for r in clock]) if clock
        else None,
        "window_cross_node_payload_bytes_per_rank": mean([cross_node_payload(r.get("window_payload_bytes_by_group"),
                                                                             per_node) for r in clock])
        if clock and per_node > 1 else None,
        "window_syncs": clock[0].get("window_syncs") if clock else None,
        # rank 0's phases in the first timing run (ms per step: compute, optimizer, hooks, encode, exchange, land)
        "phases": (clock[0].get("report") or {}).get("phases") if clock else None,
        "hidden_share": (clock[0].get("report") or {}).get("hidden_share") if clock else None,
        "config": first[0]["config"],
        "method": first[0].get("method"),
        "config_sha256": first[0].get("config_sha256") or provenance.config_sha256(first[0]["config"]),
        "commit": first[0].get("commit"),
    }


def read_paces(by_rank: Dict[str, list], moved_no_bytes: bool, ranks: int,
               cores: Optional[int]) -> Tuple[Dict[str, List[float]], str]:
    """A method's pace per repeat at each link setting from its ranks' step times (``by_rank``: link -> per
    rank, each repeat's time), by ``timing.independent``'s rule, and that rule in words (results.json's
    ``pace``).  ``summarize`` reads a new run with it, ``repace`` a recorded one."""
    averaged = timing.independent(moved_no_bytes, ranks, cores)
    if averaged:
        rule = "mean of ranks (they never wait)"
    else:
        rule = "slowest rank (the ranks share the cores)" if moved_no_bytes else "slowest rank"
    return {bw: timing.paces(times, averaged) for bw, times in by_rank.items()}, rule


def repace(results: dict) -> bool:
    """Take every method's paces again from its recorded per-rank step times (``step_ms_repeats_by_rank``) by
    today's rule (``timing.independent``), then its ratios; True where a pace changed.  For a run recorded
    before a rule changed (2026-12-07: ranks that never wait but share the cores were averaged): the
    measurements are the run's, the reading today's, and ``setup.repaced`` names the commit that read them."""
    setup, changed = results["setup"], False
    for m in results["methods"].values():
        by_rank = m.get("step_ms_repeats_by_rank")
        if not by_rank:
            return False  # recorded before the per-rank times were kept: nothing to take again
        # the mean of the ranks' payloads is 0 exactly where every rank's is (timing.never_waits)
        paces, rule = read_paces(by_rank, m["payload_bytes_per_rank"] == 0, setup["ranks"], setup.get("cores"))
        if paces != m["step_ms_paces"]:
            changed = True
            m["step_ms_paces"], m["step_ms"] = paces, {bw: statistics.median(p) for bw, p in paces.items()}
            m["pace"] = rule
    if changed:
        add_ratios(results, setup.get("target"))
        setup["repaced"] = {**provenance.commit(), "date": time.strftime("%Y-%m-%d")}
    return changed


def floor_of(config: Optional[dict]) -> Optional[str]:
    """The floor method whose time a commhooks method cannot go below: ``floor-in-node`` for a config with replica
    groups of several ranks (``group_size`` null: a node's ranks; or > 1), else ``floor-hooks``; None for a method
    that is not commhooks' (DDP, PyTorch's hooks) or a floor itself."""
    if not config or config.get("type") in (None, "none") or config.get("h_base") == 1000000000:
        return None
    size = config.get("group_size", 1)
    return "floor-in-node" if size is None or size > 1 else "floor-hooks"


def add_ratios(results: dict, target: Optional[float] = None) -> None:
    """Each method's paired ratios per link setting: its pace over compute-only's (the speed limit) and DDP's
    over its (how much faster), repeat by repeat, with the median's 95 % interval (timing.py); ``target``: a
    ratio to compute-only the interval must also clear to be resolved."""
    methods = results["methods"]
    targets = (1.0,) if target is None else (1.0, target)
    floor, ddp = methods.get("compute-only"), methods.get("ddp")
    # runs since 2026-12-06's bracketing: each method between two compute-only runs (timing.bracketed_order)
    order = timing.bracketed_order(list(methods), results["setup"].get("repeats", 1)) \
        if results["setup"].get("pairing") == "bracketed" else None
    for name, m in methods.items():
        over_floor = floor is not None and floor is not m  # a baseline against itself: None (the table's "-")
        under_ddp = ddp is not None and ddp is not m
        m["ratios"] = {}
        floor_name = floor_of(m.get("config"))
        own_floor = methods.get(floor_name) if floor_name else None
        for bw, own in m["step_ms_paces"].items():
            if not over_floor:
                vs_floor = None
            elif order is not None:
                vs_floor = timing.bracketed_ratio(own, floor["step_ms_paces"][bw], timing.brackets(order, name),
                                                  targets)
            else:
                vs_floor = timing.paired_ratio(own, floor["step_ms_paces"][bw], targets)
            if not under_ddp:
                over_ddp = None
            elif order is not None and m is floor:  # compute-only ran more often: DDP over the runs around it
                over_ddp = timing.paired_ratio(ddp["step_ms_paces"][bw], timing.bracketing(
                    own, timing.brackets(order, "ddp")))
            else:
                over_ddp = timing.paired_ratio(ddp["step_ms_paces"][bw], own)
            m["ratios"][bw] = {"vs compute-only": vs_floor, "ddp over this": over_ddp}
            if own_floor is not None and bw in own_floor["step_ms_paces"]:  # repeat k over the floor's repeat k
                m["ratios"][bw]["vs its floor"] = {**timing.paired_ratio(own, own_floor["step_ms_paces"][bw]),
                                                   "floor": floor_name}


def cpu_clock() -> dict:
    """Now: the machine's busy CPU seconds (all cores, from /proc/stat), this process's and its reaped children's
    (the bench's ranks), the 1-minute load average and the wall clock; ``machine_load`` compares two."""
    busy = None
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    except (OSError, ValueError, IndexError):
        pass
    t = os.times()
    return {"busy": busy, "own": t.user + t.system + t.children_user + t.children_system,
            "load": os.getloadavg()[0], "wall": time.monotonic()}


def machine_load(before: dict, after: dict, threshold: float = 0.25) -> dict:
    """What else ran during a link setting's runs: the CPU the machine spent beyond the bench and its ranks, in
    cores on average (``others_cores``); ``shared`` where it exceeds ``threshold`` (its times are suspect).  The
    1-minute load averages around it are kept too, but they lag by a minute (a job that ended just before the
    bench started still shows in ``load_before``), so they decide nothing."""
    wall = max(after["wall"] - before["wall"], 1e-9)
    others = None if before["busy"] is None else \
        max(0.0, (after["busy"] - before["busy"]) - (after["own"] - before["own"])) / wall
    return {"load_before": round(before["load"], 2), "load_after": round(after["load"], 2),
            "others_cores": None if others is None else round(others, 3),
            "shared": None if others is None else others > threshold}


def cross_node_payload(by_group: Optional[Dict[str, int]], per_node: int) -> Optional[float]:
    """A rank's payload on groups whose ranks sit on more than one node (groups keyed ``"0-2"``: its ranks):
    the meter's view of what crosses the node links, where no wire counter was read."""
    if by_group is None:
        return None
    return float(sum(b for g, b in by_group.items() if len({int(r) // per_node for r in g.split("-")}) > 1))


def across_nodes(results: dict) -> bool:
    return (results["setup"].get("nodes") or 1) > 1


def compared_bytes(results: dict, m: dict) -> Optional[float]:
    """The bytes the table's "vs DDP" and the picture compare: with nodes, what crosses the node links (the
    wire counter where measured, else the meter's cross-node payload); else the payload a rank sent."""
    if not across_nodes(results):
        return m["payload_bytes_per_rank"]
    if m.get("wire_tx_bytes_per_rank") is not None:
        return m["wire_tx_bytes_per_rank"]
    return m.get("cross_node_payload_bytes_per_rank")


def bytes_label(results: dict) -> str:
    if not across_nodes(results):
        return "payload sent per rank over the run (MB, log)"
    wire = any(m.get("wire_tx_bytes_per_rank") is not None for m in results["methods"].values())
    return ("bytes per rank crossing the node links, " + ("wire tx" if wire else "the meter's cross-node payload")
            + " (MB, log)")


def quality_metric(results: dict) -> str:
    """``test_acc`` (MNIST-1D) or ``val_loss`` (GPT): the column the table and the plot show."""
    return WORKLOADS[results["setup"].get("model", "cnn")].metric


def seed_mean(by_seed: Dict[int, Optional[float]], seeds: Sequence[int]) -> Optional[float]:
    """The mean over ``seeds``, or None where one of them has no figure (a mean of fewer seeds is not one)."""
    values = [by_seed.get(s) for s in seeds]
    return None if not seeds or None in values else sum(values) / len(values)


def add_seed_means(results: dict, seeds: Sequence[int], quality: Dict[str, Dict[int, float]],
                   search_seeds: Sequence[int] = ()) -> None:
    """Each method's quality metric per seed and its mean (accuracy claims use the mean); where a search chose
    the configurations on ``search_seeds``, the mean of those and of the held-out others apart (a choice among
    several variants flatters the winner on the seeds it was chosen on: quote the held-out mean)."""
    heldout = [s for s in seeds if s not in search_seeds]
    for name, by_seed in quality.items():
        m = results["methods"][name]
        m["quality_by_seed"] = {str(s): by_seed.get(s) for s in seeds}
        m["quality_mean"] = seed_mean(by_seed, seeds)
        if search_seeds:
            m["quality_search_mean"] = seed_mean(by_seed, search_seeds)
            m["quality_heldout_mean"] = seed_mean(by_seed, heldout)


def table(results: dict) -> str:
    methods, bws = results["methods"], results["setup"]["bandwidths"]
    ddp, floor = methods.get("ddp"), methods.get("compute-only")
    metric = quality_metric(results)
    seeds = results["setup"].get("seeds") or [results["setup"].get("seed", 0)]
    search = results["setup"].get("search_seeds") or []
    means = ([("quality_search_mean", f"mean of search seeds {'/'.join(map(str, search))}"),
              ("quality_heldout_mean", f"mean of held-out seeds {'/'.join(str(x) for x in seeds if x not in search)}")]
             if search else [("quality_mean", f"mean of seeds {'/'.join(map(str, seeds))}")] if len(seeds) > 1 else [])
    head = ["method", metric.replace("_", " ") + (f" (seed {seeds[0]})" if len(seeds) > 1 else "")]
    head += [label for _, label in means]
    nodes = across_nodes(results)
    head += ["syncs", "payload/rank" + (" (incl. in-node)" if nodes else ""), "vs DDP" + (" (cross-node)" if nodes else ""),
             "wire tx/rank", "config"]
    head += [f"ms/step {bw}" for bw in bws] + [f"vs compute-only {bws[-1]}", f"vs DDP {bws[-1]}", f"overhead vs DDP {bws[0]}"]
    floors = any("vs its floor" in (m.get("ratios", {}).get(bws[-1]) or {}) for m in methods.values())
    head += [f"vs its floor {bws[-1]}"] if floors else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in methods.items():
        payload = m["payload_bytes_per_rank"]
        compared, base = compared_bytes(results, m), compared_bytes(results, ddp) if ddp else None
        row = [name, f"{m[metric]:.4f}"]
        row += ["-" if m.get(key) is None else f"{m[key]:.4f}" for key, _ in means]
        row += ["-" if m.get("syncs") is None else str(m["syncs"]), f"{payload / 1e6:.2f} MB",
               f"{compared / base:.3f}" if base and compared is not None else "-",
               "-" if m["wire_tx_bytes_per_rank"] is None else f"{m['wire_tx_bytes_per_rank'] / 1e6:.2f} MB",
               (m.get("config_sha256") or "-")[:8]]
        row += [f"{m['step_ms'][bw]:.2f}" for bw in bws]
        last, first = bws[-1], bws[0]
        paired = m.get("ratios", {}).get(last)
        if paired:  # a run under the paired protocol: the median ratio, its interval, resolved or not
            row.append(timing.describe(paired["vs compute-only"]) if m is not floor else "1x")
            row.append("-" if paired["ddp over this"] is None else timing.describe(paired["ddp over this"]) + " faster")
        else:  # a run recorded before the protocol
            row.append(f"{m['step_ms'][last] / floor['step_ms'][last]:.2f}x" if floor else "-")
            row.append(f"{ddp['step_ms'][last] / m['step_ms'][last]:.2f}x faster" if ddp else "-")
        row.append(f"{m['step_ms'][first] / ddp['step_ms'][first]:.2f}" if ddp else "-")
        if floors:
            over = (paired or {}).get("vs its floor")
            row.append("-" if over is None else f"{timing.describe(over)} ({over['floor']})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + ["", provenance_line(results)])


def provenance_line(results: dict) -> str:
    """What the table's figures are, under it: one run of one commit, how time and quality were measured."""
    s = results["setup"]
    text = (f"One run, {provenance.describe(s.get('commit'), s.get('dirty'))}, {s.get('date', 'undated')}; "
            "config = the first 8 hex digits of its SHA-256.")
    if s.get("cpu"):  # runs compare bit for bit only on one instruction set (provenance.machine)
        text += f" Processor: {s['cpu']['model']}, torch's kernels {s['cpu']['capability']}."
    shared = [bw for bw, load in (s.get("load") or {}).items() if load.get("shared")]
    if shared:
        text += (f" SHARED: other processes used the CPU during the timing at {', '.join(shared)} "
                 f"({', '.join(str(s['load'][bw].get('others_cores')) for bw in shared)} cores): those times are suspect.")
    if s.get("repaced"):
        by = provenance.describe(s["repaced"]["commit"], s["repaced"]["dirty"])
        text += (f" Paces taken again from the run's per-rank times by {by} on {s['repaced']['date']}: ranks that "
                 "never wait but share the cores are paced by the slowest, as ranks that sync.")
    if "time_steps" not in s:
        return text + " Recorded before the quality and time runs were apart: time and quality from the same runs."
    window = "the whole schedule" if s["time_steps"] == s["steps"] else f"the schedule's first {s['time_steps']} steps"
    if s.get("whole_schedule") and s["time_steps"] != s["steps"]:
        window += f" ({', '.join(s['whole_schedule'])}: the whole schedule)"
    seeds = s.get("seeds") or [s.get("seed", 0)]
    bracketed = (", each between two compute-only runs; ratios paired per repeat (against compute-only: the "
                 "geometric mean of the runs around it)" if s.get("pairing") == "bracketed" else
                 "; ratios paired per repeat")
    first = "after its first step" if s.get("window_rule") == "after the first step" else "after its first tenth"
    verdict = (f"median [95 % bootstrap interval], resolved where the interval clears 1.0"
               f"{' and the target ' + str(s['target']) if s.get('target') else ''}" if s.get("repeats", 1) >=
               timing.MIN_REPEATS else f"median (the range of the {s.get('repeats', 1)} repeats: too few for an "
               f"interval, at least {timing.MIN_REPEATS} give one; no verdict)")
    return (text + f" Time: {s.get('repeats', 1)} interleaved repeat(s) of {window} per link setting, each timed "
            f"{first}{bracketed}, {verdict}; the bytes beside a time are the same steps'. "
            f"Quality: full runs on an unlimited link, seed(s) {', '.join(map(str, seeds))}"
            + (f"; the configurations were chosen on seeds {', '.join(map(str, s['search_seeds']))}."
               if s.get("search_seeds") else "."))


def title(results: dict) -> str:
    s = results["setup"]
    workload = "byte-level GPT" if quality_metric(results) == "val_loss" else f"MNIST-1D {s['model'].upper()}"
    where = f"{s['ranks']} ranks on {s['nodes']} nodes" if across_nodes(results) else f"{s['ranks']} ranks"
    engine = ", FSDP2 sharded in each node (ddp: FSDP2's own HSDP)" if s.get("engine") == "fsdp" else ""
    return f"{workload}, {where}, {s['steps']} steps{engine}"


def plots(results: dict, out: Path) -> List[str]:
    """The run's pictures (figures.py): quality against bytes with the seeds' range, time against bandwidth with
    the repeats' interval, and, where the states timed their phases, each method's step by phase beside its floor."""
    from .figures import plots as draw

    return draw(results, out, metric=quality_metric(results), x_of=lambda m: compared_bytes(results, m),
                x_label=bytes_label(results), heading=title(results),
                link=f"link per {'node' if across_nodes(results) else 'rank'} ({results['setup']['network']})",
                ours={n for n in results["methods"] if n not in METHODS or "--config" in METHODS[n]}, floor_of=floor_of)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="commhooks bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma list from: {', '.join(METHODS)}; or label=path/to/config.json (a config of one's own)")
    p.add_argument("--engine", choices=("ddp", "fsdp"), default="ddp",
                   help="fsdp: FSDP2 shards the model over each node's ranks; the method syncs across nodes, and "
                        "ddp is FSDP2's own HSDP (PyTorch's own hooks, compute-only among them, stay on DDP)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--nodes", type=int, default=None,
                   help="simulated nodes (default: one per rank): a node's ranks share one namespace and one "
                        "rate-limited link; inside it they talk unlimited. AB's and QSR's node-sized groups follow")
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps per run (default {WORKLOADS['cnn'].bench_steps}; gpt {WORKLOADS['gpt'].bench_steps})")
    p.add_argument("--model", choices=tuple(WORKLOADS), default="cnn",
                   help="cnn / mlp: MNIST-1D; gpt: the byte-level GPT (validation loss instead of accuracy)")
    p.add_argument("--seed", type=int, default=0, help="the seed of every run (one seed; see --seeds)")
    p.add_argument("--seeds", default=None,
                   help="comma list, e.g. 0,1,2: the quality column's seeds (full runs on an unlimited link; the "
                        "table shows their mean); the timing runs use the first")
    p.add_argument("--search-seeds", default=None,
                   help="the seeds among --seeds on which a search chose these configurations: the table shows "
                        "their mean and the held-out seeds' mean apart (quote the held-out one)")
    p.add_argument("--time-steps", type=int, default=None,
                   help="timing runs stop after this many steps of the full schedule (default: the whole "
                        "schedule); each is timed after its first tenth")
    p.add_argument("--whole-schedule", default="", metavar="METHODS",
                   help="comma list of --methods whose timing runs cover the whole schedule despite --time-steps: "
                        "a method whose syncs change over the schedule (QSR's rule syncs every h_base steps while "
                        "the learning rate is high, rarely once it decays) is timed where it saves, not only in "
                        "its first steps")
    p.add_argument("--target", type=float, default=None,
                   help="a ratio to compute-only that an interval must also clear to be called resolved")
    p.add_argument("--repeats", type=int, default=None,
                   help="run each method this many times per link setting, interleaved: each repeat gives a paired "
                        "ratio against compute-only and DDP, the table their median and 95 %% interval (and 'not "
                        "resolved' where it holds 1.0); default 15, 1 with --quick")
    p.add_argument("--stages", choices=("all", "quality"), default="all",
                   help="quality: run only the seeds' quality stages and stop (they need no quiet machine); then "
                        "--stages all --resume at the same commit reuses them and runs the timing")
    p.add_argument("--pin", choices=("auto", "off"), default="auto",
                   help="auto: each rank pinned to a core of its own where the ranks fit on the cores (recorded)")
    p.add_argument("--bandwidths", default=",".join(BANDWIDTHS), help="comma list of tc rates at which to time the methods")
    p.add_argument("--delay", default="1ms", help="netem delay added on limited links")
    p.add_argument("--netns", choices=("auto", "on", "off"), default="auto",
                   help="auto: namespaces when root, else loopback; on: fail if they cannot be made")
    p.add_argument("--out", default="results/bench")
    p.add_argument("--cache-dir", default=os.environ.get("COMMHOOKS_CACHE", ".cache"))
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds for all methods at one link setting")
    p.add_argument("--resume", action="store_true",
                   help="reuse the stages (a link setting's timing, a seed's quality runs) that an earlier run of "
                        "the same command left finished in --out at this same clean commit; run the rest")
    p.add_argument("--quick", action="store_true", help="20 steps, loopback, unlimited only (a smoke test)")
    p.add_argument("--compare-phases", nargs=2, metavar=("BEFORE", "AFTER"),
                   help="print each method's phases (ms per step) in two recorded runs (e.g. of two commits) side by "
                        "side with their ratio, then stop: a change that makes a step slower shows in its phase")
    p.add_argument("--replot", metavar="DIR",
                   help="only redraw DIR's table.md and pictures from its results.json (a recorded run), then stop")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else DEFAULT_REPEATS
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    args.timeout *= args.repeats  # the limit is per link setting, for every run of every method
    if args.steps is None:
        args.steps = WORKLOADS[args.model].bench_steps
    if args.quick:
        args.steps, args.netns, args.bandwidths = min(args.steps, 20), "off", "unlimited"
    if args.time_steps is None:
        args.time_steps = args.steps
    elif not 10 <= args.time_steps <= args.steps:
        p.error(f"--time-steps must be from 10 to --steps ({args.steps}), got {args.time_steps}")
    try:
        args.methods, args.method_configs = split_methods([m.strip() for m in args.methods.split(",") if m.strip()])
    except ValueError as exc:
        p.error(f"--methods: {exc}")
    args.whole_schedule = [m.strip() for m in args.whole_schedule.split(",") if m.strip()]
    if set(args.whole_schedule) - set(args.methods):
        p.error(f"--whole-schedule must name some of --methods ({', '.join(args.methods)}), got "
                f"{', '.join(sorted(set(args.whole_schedule) - set(args.methods)))}")
    args.bandwidths = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
    try:
        args.seeds = [args.seed] if args.seeds is None else [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be a comma list of integers, got {args.seeds!r}")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must list distinct integers, got {args.seeds}")
    args.seed = args.seeds[0]
    try:
        args.search_seeds = [] if args.search_seeds is None else [int(x) for x in args.search_seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--search-seeds must be a comma list of integers, got {args.search_seeds!r}")
    if args.search_seeds and (set(args.search_seeds) - set(args.seeds) or set(args.search_seeds) >= set(args.seeds)):
        p.error(f"--search-seeds must be some of --seeds ({args.seeds}), leaving at least one held out; "
                f"got {args.search_seeds}")
    if args.nodes is not None and (args.nodes < 1 or args.ranks % args.nodes):
        p.error(f"--nodes must divide --ranks ({args.ranks}), got {args.nodes}")
    return args


def compare_phases(before: dict, after: dict) -> List[str]:
    """Markdown rows: per method in both runs and per phase (commhooks/phases.py), its ms per step in each run and
    after / before; the runs' commits in the heading.  Rank 0's first timing run in each: one sample each, so a
    difference is a lead to follow (rerun both under the protocol), not a verdict."""
    from .figures import PHASE_ORDER

    head = (f"| method | phase | {provenance.describe(before['setup'].get('commit'), before['setup'].get('dirty'))} "
            f"| {provenance.describe(after['setup'].get('commit'), after['setup'].get('dirty'))} | after / before |")
    rows = [head, "|---|---|---|---|---|"]
    for name, old in before["methods"].items():
        new = after["methods"].get(name)
        if not old.get("phases") or not new or not new.get("phases"):
            continue
        for phase in PHASE_ORDER + ("step",):
            if phase == "step":
                a = sum(old["phases"][p]["ms_per_step"] for p in PHASE_ORDER if p in old["phases"])
                b = sum(new["phases"][p]["ms_per_step"] for p in PHASE_ORDER if p in new["phases"])
            else:
                a = old["phases"].get(phase, {}).get("ms_per_step", 0.0)
                b = new["phases"].get(phase, {}).get("ms_per_step", 0.0)
            ratio = f"{b / a:.2f}x" if a else "-"
            rows.append(f"| {name} | {phase} | {a:.3f} | {b:.3f} | {ratio} |")
    return rows


def replot(directory: Path) -> int:
    """Redraw a recorded run's table and pictures from its ``results.json`` (nothing is run); where today's
    pace rule reads its recorded per-rank times otherwise (``repace``), write the new reading into it first."""
    results = json.loads((directory / "results.json").read_text())
    if repace(results):
        print(f"commhooks bench --replot: paces and ratios taken again by today's rule "
              f"({provenance.describe(results['setup']['repaced']['commit'], results['setup']['repaced']['dirty'])})")
        (directory / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    md = table(results)
    (directory / "table.md").write_text(md + "\n")
    plots(results, directory)
    print(md)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    if args.compare_phases:
        runs = [json.loads((Path(d) / "results.json").read_text()) for d in args.compare_phases]
        rows = compare_phases(*runs)
        if len(rows) == 2:
            raise SystemExit("commhooks bench --compare-phases: no method has phases in both runs (runs recorded "
                             "before the phase clock have none)")
        print("\n".join(rows))
        return 0
    if args.replot:
        return replot(Path(args.replot))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(args, out)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args, out: Path) -> int:
    lab, network = None, "loopback"
    timed: Dict[str, Dict[str, List[dict]]] = {}  # link setting -> method -> per-rank summaries
    by_seed: Dict[int, Dict[str, List[dict]]] = {}  # seed -> method -> per-rank summaries of a full run
    results: dict = {}
    try:
        if args.netns != "off":
            try:
                if os.geteuid() != 0:
                    raise LabError("not root")
                stale = remove_stale_lab()
                if stale:
                    print(f"commhooks bench: removed what a dead earlier run left: {', '.join(stale)}", flush=True)
                lab = NetnsLab(args.ranks, nodes=args.nodes).__enter__()
                network = ("netns + veth + bridge, tc per rank" if lab.per_node == 1 else
                           f"netns + veth + bridge, {lab.nodes} nodes of {lab.per_node} ranks sharing one tc-limited link each")
            except LabError as exc:
                if args.netns == "on":
                    raise
                print(f"commhooks bench: no network namespaces ({exc}); falling back to loopback, payload bytes only",
                      flush=True)
        if lab is None and any(bw != "unlimited" for bw in args.bandwidths):
            print("commhooks bench: loopback cannot be rate-limited; measuring 'unlimited' only", flush=True)
            args.bandwidths = ["unlimited"]
        # on loopback --nodes still groups the ranks by node (LOCAL_WORLD_SIZE): "vs DDP" then compares the bytes
        # the meter counts on groups spanning nodes, as the wire counter would with namespaces
        results = {"setup": {"ranks": args.ranks, "nodes": lab.nodes if lab else args.nodes, "steps": args.steps,
                             "time_steps": args.time_steps, "whole_schedule": args.whole_schedule,
                             "model": args.model, "engine": args.engine,
                             "seed": args.seed, "seeds": args.seeds, "search_seeds": args.search_seeds,
                             "method_configs": args.method_configs,
                             "repeats": args.repeats, "target": args.target, "pairing": "bracketed" if timing.bracketed(args.methods, args.repeats) else "rounds",
                             "window_rule": "after the first step",
                             "bandwidths": args.bandwidths, "delay": args.delay, "network": network,
                             "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "cpu": provenance.machine(),
                             **provenance.commit(),
                             "pinned": pinned(args), "load": {}}, "methods": {}}
        def time_stages():
            for bw in args.bandwidths:  # time: interleaved repeats at each link setting
                shaping = lab.shape(bw, args.delay) if lab else "none"
                results["setup"].setdefault("shaping", {})[bw] = shaping
                print(f"[bench] link {bw}: {shaping} ({network}), {args.repeats} repeat(s)", flush=True)
                timed[bw] = run_bandwidth(args.methods, args, lab, out / f"time-{bw}", args.timeout,
                                          stop_after=args.time_steps, resume=args.resume)
                results["setup"]["load"][bw] = json.loads((out / f"time-{bw}" / "done.json").read_text())["load"]

        def quality_stages():
            for seed in [x for x in args.seeds if x not in by_seed]:  # full runs: the link does not change them
                shaping = lab.shape("unlimited", args.delay) if lab else "none"
                print(f"[bench] seed {seed}: quality runs, link unlimited ({shaping})", flush=True)
                by_seed[seed] = run_bandwidth(args.methods, args, lab, out / f"seed{seed}",
                                              args.timeout / args.repeats, seed=seed, repeats=1, resume=args.resume)

        if args.stages == "quality":  # the quality stages alone (the time later, on a quiet machine: --resume)
            quality_stages()
            print(f"[bench] quality stages done in {out}; run again with --stages all --resume for the time",
                  flush=True)
            return 0
        time_stages()
        if "unlimited" in timed and args.time_steps == args.steps:  # a whole run of the first seed, unlimited
            by_seed[args.seeds[0]] = timed["unlimited"]
        quality_stages()
    finally:
        if lab:
            lab.__exit__()
    results["setup"]["resumed"] = args.resume  # when each stage finished: a resumed run shows its gaps
    results["setup"]["stages"] = {d.name: json.loads((d / "done.json").read_text())["finished"]
                                  for d in [out / f"time-{bw}" for bw in timed] + [out / f"seed{x}" for x in by_seed]
                                  if (d / "done.json").exists()}
    per_node = args.ranks // (results.get("setup", {}).get("nodes") or args.ranks)
    metric = WORKLOADS[args.model].metric
    for name in args.methods:
        results["methods"][name] = summarize(by_seed[args.seeds[0]][name], {bw: timed[bw][name] for bw in timed},
                                             per_node, results["setup"]["cores"])
    add_seed_means(results, args.seeds, {name: {seed: by_seed[seed][name][0][metric] for seed in args.seeds}
                                         for name in args.methods}, args.search_seeds)
    add_ratios(results, args.target)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    md = table(results)
    (out / "table.md").write_text(md + "\n")
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
