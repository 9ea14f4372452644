"""`commhooks plan`: bytes and step time of every method on a cluster larger than this machine, predicted.

Bytes come from each method's traffic declaration: a registered algorithm's
(``register_algorithm(..., traffic=...)``, for any config of it: ``--config
FILE``), PyTorch's baselines' (:mod:`commhooks.tools.anchor_traffic`); the
meter tests check the declarations to the byte and tests/test_plan.py against
recorded benchmarks.  The planner itself has no byte formula and names no
method.  Time from a latency-bandwidth model of the collectives:

* allreduce of ``B`` bytes over ``p = n g`` ranks on ``n`` nodes (a ring through
  every rank, as gloo and NCCL's rings run it: each node's link carries
  ``2 (p-1)/p B``): ``2 (p-1)/p * B / inter + calls * 2 (p-1) * latency``
  (on one node: the same over ``intra``);
* allgather of ``B`` bytes per rank (compressed payloads):
  ``(g-1) B / intra + (n-1) g B / inter + calls * latency``;
* all-to-all of ``B`` bytes per rank (``B / p`` to each rank: the two-step compressed mean's first half):
  each node's link carries the pieces its ``g`` ranks send to other nodes, ``(n-1)/n g B / inter``,
  and ``(g-1)/p B / intra`` inside it;
* collectives inside a node (a replica group's gradient mean, a hierarchical
  sync's parts shared) run over ``intra``; a hierarchical sync's ``1/g`` part
  crosses the nodes as ``g`` rings of ``n`` ranks side by side
  (``--replica-groups`` turns replica groups of a node and ``hierarchical`` on
  for the configs that have them).

``--engine fsdp``: the model sharded by FSDP2 over a node's ranks.  Every method then also carries FSDP2's own
traffic inside the node each step (two all-gathers of the rank's shard, a reduce-scatter of the gradients); the
algorithms sync shards across the nodes, and DDP's row is FSDP2's own HSDP (its shard all-reduced across the
nodes every step).

Links run at ``efficiency`` of their rate (TCP/IP over Ethernet frames carries
~94 % payload).  A step is ``compute + method overhead + communication -
hidden``: an overlapped sync (its calls declared ``behind`` steps ahead of their
landing) hides behind the compute of those steps, up to their compute time
(:func:`hidden_ms`); nothing else overlaps (DDP overlaps part of its allreduce
with backward, so DDP's prediction errs long on fast links).  Method overhead (PowerSGD's
orthogonalisation, AB's projections) is unknown for a model you have not run:
``--calibrate`` takes it from a benchmark JSON (each method's step time on the
unlimited link minus compute-only's).  Predictions for clusters you have not
measured are predictions: the docs say so next to them.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..algorithms.contract import STEP_PROOF_BYTES as PROOF  # the step proof in every commhooks sync
from ..algorithms.traffic import Setting, Traffic as Declared
from ..algorithms.traffic import describe
from .anchor_traffic import COMPUTE_ONLY, DENSE, ENGINES, anchor_label, anchor_traffic, fsdp_traffic, hsdp_traffic
from .peers import PEERS

DDP, FSDP = ENGINES

Shapes = List[Tuple[str, Tuple[int, ...]]]

# ----------------------------------------------------------------------------- models


def _torch_shapes(name: str) -> Shapes:
    from .models import build_model

    return [(n, tuple(p.shape)) for n, p in build_model(name).named_parameters()]


def _vgg16() -> Shapes:
    cfg = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    shapes, c = [], 3
    for i, o in enumerate(cfg):
        shapes += [(f"conv{i}.weight", (o, c, 3, 3)), (f"conv{i}.bias", (o,))]
        c = o
    for i, (a, b) in enumerate(((4096, 25088), (4096, 4096), (1000, 4096))):
        shapes += [(f"fc{i}.weight", (a, b)), (f"fc{i}.bias", (a,))]
    return shapes


def _resnet50() -> Shapes:
    shapes: Shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1", (2 * 64,))]
    inplanes = 64
    for stage, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for b in range(blocks):
            p = f"layer{stage + 1}.{b}"
            shapes += [(f"{p}.conv1", (planes, inplanes, 1, 1)), (f"{p}.bn1", (2 * planes,)),
                       (f"{p}.conv2", (planes, planes, 3, 3)), (f"{p}.bn2", (2 * planes,)),
                       (f"{p}.conv3", (4 * planes, planes, 1, 1)), (f"{p}.bn3", (8 * planes,))]
            if b == 0:
                shapes += [(f"{p}.down", (4 * planes, inplanes, 1, 1)), (f"{p}.down_bn", (8 * planes,))]
            inplanes = 4 * planes
    return shapes + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def _vit_b16() -> Shapes:
    d, shapes = 768, [("patch.weight", (768, 3, 16, 16)), ("patch.bias", (768,)), ("pos", (197 * 768,))]
    for i in range(12):
        shapes += [(f"b{i}.qkv", (3 * d, d)), (f"b{i}.qkv_b", (3 * d,)), (f"b{i}.proj", (d, d)),
                   (f"b{i}.mlp1", (4 * d, d)), (f"b{i}.mlp2", (d, 4 * d)), (f"b{i}.vec", (4 * d + 5 * d,))]
    return shapes + [("head", (1000, d)), ("head_b", (1000,))]


def _lm_1b() -> Shapes:
    d, layers, vocab = 2048, 24, 50304
    shapes: Shapes = [("embed", (vocab, d))]  # tied with the output head
    for i in range(layers):
        shapes += [(f"l{i}.qkv", (3 * d, d)), (f"l{i}.proj", (d, d)), (f"l{i}.mlp1", (4 * d, d)),
                   (f"l{i}.mlp2", (d, 4 * d)), (f"l{i}.vec", (13 * d,))]
    return shapes


MODELS = {"cnn": lambda: _torch_shapes("cnn"), "mlp": lambda: _torch_shapes("mlp"), "gpt": lambda: _torch_shapes("gpt"),
          "vgg16": _vgg16,
          "resnet50": _resnet50, "vit-b16": _vit_b16, "lm-1b": _lm_1b}


def model_buffers(name: str) -> int:
    """Floating buffer elements (BatchNorm statistics) of a torch model the planner builds; 0 for the others."""
    if name not in ("cnn", "mlp", "gpt") and ":" not in name:
        return 0
    from .models import build_model

    model = build_model(name) if ":" not in name else None
    if model is None:
        import importlib

        module, attr = name.split(":", 1)
        model = getattr(importlib.import_module(module), attr)()
    return sum(b.numel() for b in model.buffers() if b.is_floating_point())


def model_shapes(name: str) -> Shapes:
    """Parameter shapes of a known model, or of ``module:callable`` (a torch module factory)."""
    if name in MODELS:
        return MODELS[name]()
    if ":" in name:
        import importlib

        module, attr = name.split(":", 1)
        model = getattr(importlib.import_module(module), attr)()
        return [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    raise ValueError(f"--model must be one of {', '.join(MODELS)} or module:callable, got {name!r}")


# ----------------------------------------------------------------------------- bytes


@dataclass
class Schedule:
    """The run the declarations are asked about: steps, lr warm-up then cosine to zero (the trainer's), peak lr."""

    steps: int = 1200
    warmup: int = 50
    peak_lr: float = 0.003
    anchor_start: int = 50  # PowerSGD / post-local SGD: plain allreduce steps first

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def bench_schedule(setup: dict) -> Schedule:
    """The schedule a ``commhooks bench`` run trained with (its workload's peak lr, the trainer's warm-up)."""
    from .workloads import WORKLOADS

    workload = WORKLOADS.get(setup["model"])
    return Schedule(steps=setup["steps"], peak_lr=workload.defaults["lr"] if workload else Schedule.peak_lr)


def read_config(path: str) -> dict:
    """A config file (or a shipped config's name; a DeepSpeed config: its ``"comm_hook"`` section) as a dict."""
    from ..config import ConfigError, read_json
    from ..shipped import find, is_bare_name

    if not Path(path).is_file() and not is_bare_name(path):
        raise ConfigError(f"config file {path!r} not found")
    try:
        raw = read_json(path) if Path(path).is_file() else read_json(find(path))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return raw.get("comm_hook", raw) if isinstance(raw, dict) else raw


def declared(source: dict, shapes: Shapes, schedule: Schedule, layout: "Layout", proof: int = PROOF,
             overrides: Optional[dict] = None, buffers: int = 0, rank: int = 0,
             moments_per_param: int = 2, same_start: bool = True, engine: str = DDP) -> Optional[Declared]:
    """The declared traffic of one method: ``{"config": path or dict}`` (its registered algorithm declares it, asked
    for a run of ``schedule.steps`` steps) or a baseline ``{"hook": ...}`` (:mod:`.anchor_traffic`).
    ``moments_per_param``: optimizer moments a sync may average (AdamW: 2).  ``same_start``: the ranks start
    from the same weights (runs recorded before 2026-12-05 averaged them anyway: False).  ``engine`` ``fsdp``:
    the method on FSDP2 sharded over a node's ranks (FSDP2's own part in the node: ``fsdp_traffic``): an algorithm
    syncs its shards across the nodes (None if it cannot run on shards), DDP's baseline is FSDP2's HSDP, the
    other PyTorch hooks do not run there (None), compute-only stays what it is."""
    setting = Setting.of(shapes, world=layout.world, local_world=layout.ranks_per_node, rank=rank,
                         steps=schedule.steps, lr=schedule.lr, proof_bytes=proof, buffers=buffers,
                         moments=moments_per_param * sum(math.prod(s) for _, s in shapes), same_start=same_start,
                         engine_data_parallel=engine == FSDP, shard_rows=engine == FSDP)
    if "hook" in source:
        if source["hook"] in PEERS:  # torchft's own classes declare no traffic: the bench measures theirs
            return None
        if engine == FSDP and source["hook"] == DENSE:
            return hsdp_traffic(setting)
        if engine == FSDP and source["hook"] != COMPUTE_ONLY:
            return None
        return anchor_traffic(source["hook"], setting, source.get("powersgd_rank", 4), source.get("local_period", 8),
                              schedule.anchor_start)
    from .. import registry
    from ..config import ConfigError, load_config

    raw = source["config"] if isinstance(source["config"], dict) else read_config(source["config"])
    algorithm = registry.get(raw.get("type", ""))
    fields = algorithm.config_class.model_fields
    if engine == FSDP:
        if not algorithm.state_class.engine_data_parallel:
            return None  # refused on a sharded model (commhooks.fsdp says why)
        overrides = {**(overrides or {}), "group_size": layout.ranks_per_node}  # the shard group, as register sets
    raw = {**raw, **{k: v for k, v in (overrides or {}).items() if k in fields}}
    if "total_steps" in fields:
        raw["total_steps"] = schedule.steps
    try:
        conf = load_config(raw)
    except ConfigError as exc:  # which of several files
        label = source.get("label") or (source["config"] if isinstance(source["config"], str) else None)
        raise (ConfigError(f"{label}: {exc}") if label else exc) from None
    return algorithm.declare_traffic(conf, setting)


@dataclass
class Load:
    """A method's average traffic per optimizer step by collective and scope (:mod:`commhooks.algorithms.traffic`:
    ``world``, ``group`` = inside a node, ``across`` = one rank per node, ``g`` side by side), and its calls."""

    allreduce: float = 0.0
    allreduce_across: float = 0.0
    allreduce_intra: float = 0.0
    allgather: float = 0.0
    allgather_across: float = 0.0
    allgather_intra: float = 0.0
    alltoall: float = 0.0
    alltoall_across: float = 0.0
    alltoall_intra: float = 0.0
    broadcast_across: float = 0.0
    broadcast: float = 0.0
    broadcast_intra: float = 0.0
    calls: float = 0.0
    calls_across: float = 0.0
    calls_intra: float = 0.0
    measured: bool = False  # bytes taken from a benchmark, not from a declaration

    def __add__(self, other: "Load") -> "Load":
        return Load(**{f: getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__ if f != "measured"},
                    measured=self.measured)

    @classmethod
    def of(cls, t: Declared, layout: "Layout", calls=None, steps: Optional[int] = None) -> "Load":
        """``t``'s calls (or ``calls`` of it) averaged over its steps (or ``steps``); a replica group larger than a
        node (its collectives cross the nodes) counts as the world."""
        names = {"world": "", "across": "_across", "group": "_intra" if t.group <= layout.ranks_per_node else ""}
        totals: Dict[str, int] = {}
        for c in t.sends() if calls is None else calls:
            scope = names[c.scope]
            totals[c.kind + scope] = totals.get(c.kind + scope, 0) + c.nbytes
            totals["calls" + scope] = totals.get("calls" + scope, 0) + 1
        return cls(**{k: v / max(1, t.steps if steps is None else steps) for k, v in totals.items()})

    def between_nodes(self, layout: "Layout") -> float:
        """Of :attr:`payload`, what this rank hands to collectives that span nodes."""
        world = self.allreduce + self.allgather + self.alltoall + self.broadcast if layout.nodes > 1 else 0.0
        return world + self.allreduce_across + self.allgather_across + self.alltoall_across + self.broadcast_across

    @property
    def payload(self) -> float:
        return (self.allreduce + self.allreduce_across + self.allreduce_intra + self.allgather + self.allgather_across
                + self.allgather_intra + self.alltoall + self.alltoall_across + self.alltoall_intra + self.broadcast
                + self.broadcast_across + self.broadcast_intra)


# ----------------------------------------------------------------------------- time


@dataclass
class Layout:
    nodes: int = 2
    ranks_per_node: int = 1
    inter_gbit: float = 0.1
    intra_gbit: float = 100.0
    latency_us: float = 50.0
    efficiency: float = 0.94

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


def comm_ms(t: Load, layout: Layout) -> float:
    """Communication time per step (ms) of load ``t`` on ``layout``."""
    n, g = layout.nodes, layout.ranks_per_node
    inter = layout.inter_gbit * 1e9 / 8 * layout.efficiency  # bytes/s
    intra = layout.intra_gbit * 1e9 / 8 * layout.efficiency
    p = n * g
    seconds = 0.0
    if n > 1:  # one ring through every rank: each node's link carries 2 (p-1)/p of the payload
        seconds += 2 * (p - 1) / p * t.allreduce / inter + t.broadcast / inter
        seconds += 2 * (n - 1) / n * g * t.allreduce_across / inter  # g rings of n ranks side by side
        seconds += (n - 1) * g * (t.allgather + t.allgather_across) / inter + g * t.broadcast_across / inter
        seconds += (n - 1) / n * g * (t.alltoall + t.alltoall_across) / inter  # the pieces for other nodes
    elif g > 1:
        seconds += 2 * (g - 1) / g * t.allreduce / intra + t.broadcast / intra
    seconds += (g - 1) * t.allgather / intra + (g - 1) / p * t.alltoall / intra
    if g > 1:  # inside the node
        seconds += 2 * (g - 1) / g * t.allreduce_intra / intra + (g - 1) * t.allgather_intra / intra
        seconds += (g - 1) / g * t.alltoall_intra / intra
        seconds += g * t.broadcast_intra / intra  # each rank of the node broadcasts its share in turn
    steps = t.calls * 2 * (p - 1) + t.calls_across * 2 * (n - 1) + t.calls_intra * 2 * (g - 1)  # a ring's steps
    return 1000 * (seconds + steps * layout.latency_us * 1e-6)


def hidden_ms(t: Declared, layout: Layout, busy_ms: float) -> float:
    """Communication per step (ms) that overlapped calls hide: each call sent ``behind`` steps ahead of its
    landing (:class:`~commhooks.algorithms.traffic.Send`) runs during those steps, so up to ``behind *
    busy_ms`` of its time is hidden (what is left is waited for when it lands).  The CPU time a call takes
    away from the steps it hides behind is not modelled (the benchmark's overhead calibration holds part of it)."""
    hidden = 0.0
    for c in t.sends():
        if c.behind:
            hidden += min(comm_ms(Load.of(t, layout, [c], steps=1), layout), c.behind * busy_ms)
    return hidden / max(1, t.steps)


def predict(methods: Dict[str, dict], shapes: Shapes, layout: Layout, compute_ms: float, schedule: Schedule,
            overhead_ms: Optional[Dict[str, float]] = None, measured_bytes: Optional[Dict[str, float]] = None,
            overrides: Optional[dict] = None, proof: int = PROOF, buffers: int = 0, engine: str = DDP) -> List[dict]:
    """One row per method (label -> source, see :func:`declared`): bytes per rank per step, predicted step time,
    speed-up against DDP (the dense allreduce baseline, when among them; FSDP2's HSDP with ``engine`` fsdp).  A
    declaration that is only a bound (AB: its ranks come from the data) gives way to ``measured_bytes`` where the
    benchmark measured them.  FSDP2's own traffic in the node (``fsdp_traffic``) is added to every method it runs."""
    rows = []
    own = fsdp_traffic(Setting.of(shapes, world=layout.world, local_world=layout.ranks_per_node,
                                  steps=schedule.steps)) if engine == FSDP else None
    for label, source in methods.items():
        t = declared(source, shapes, schedule, layout, proof, overrides, buffers, engine=engine)
        if t is not None and t.exact:
            load = Load.of(t, layout)
        elif measured_bytes and label in measured_bytes:
            load = Load(allreduce=measured_bytes[label] / schedule.steps, calls=1, measured=True)
        elif t is not None:
            load = Load.of(t, layout)
        else:
            continue
        if own is not None and source.get("hook") != COMPUTE_ONLY and not load.measured:
            load = load + Load.of(own, layout)
        busy = compute_ms + (overhead_ms or {}).get(label, 0.0)
        hidden = hidden_ms(t, layout, busy) if t is not None and not load.measured else 0.0
        step = busy + comm_ms(load, layout) - hidden
        rows.append({"method": label, "bytes_per_step": load.payload, "step_ms": step, "hidden_ms": hidden,
                     "vs_compute_only": step / compute_ms if compute_ms else None,
                     "bytes_between_nodes_per_step": load.between_nodes(layout),
                     "bytes_measured": load.measured, "bytes_bound": not load.measured and not t.exact,
                     "syncs": None if t is None else t.syncs, "dense": source.get("hook") == DENSE,
                     "declared": t})
    dense = next((r["step_ms"] for r in rows if r["dense"]), None)
    for r in rows:
        r["speedup_vs_ddp"] = dense / r["step_ms"] if dense else None
    return rows


# ----------------------------------------------------------------------------- validation


def _bench():
    from . import bench

    return bench


def _unlimited_ms(folder: Path, setup: dict, methods: dict) -> Dict[str, float]:
    """Each method's step time on an unlimited link: the run's own, or, for a run measured on limited links only,
    that of its second seed's quality run (``seed<k>/``: those run on an unlimited link)."""
    if "unlimited" in setup["bandwidths"]:
        return {name: m["step_ms"]["unlimited"] for name, m in methods.items()}
    seeds = setup.get("seeds") or []
    if len(seeds) < 2:
        raise SystemExit(f"{folder}: no run on an unlimited link to calibrate the methods' overhead with")
    return {name: json.loads((folder / f"seed{seeds[1]}" / f"{name}.rank0.json").read_text())["step_ms"]
            for name in methods}


def validate(bench_json: str) -> List[dict]:
    """Predicted vs measured step time for every method and limited link of a ``commhooks bench`` run.

    Calibration per method from the same run: compute-only's step time at each link (the machine's compute
    there) and the method's overhead on the unlimited link (:func:`_unlimited_ms`).  Bytes from the declarations (measured ones where a
    declaration is only a bound, e.g. AB, whose ranks the data decides)."""
    data = json.loads(open(bench_json).read())
    setup, methods = data["setup"], data["methods"]
    unlimited = _unlimited_ms(Path(bench_json).parent, setup, methods)
    shapes = model_shapes(setup["model"])
    schedule = bench_schedule(setup)
    engine = setup.get("engine", DDP)
    sources = {name: _bench().method_source(name, setup["model"]) for name in methods if name in _bench().METHODS}
    co = next(k for k, v in sources.items() if v.get("hook") == COMPUTE_ONLY)
    base = methods[co]["step_ms"]
    rows = []
    nodes = setup.get("nodes") or setup["ranks"]
    for bw in setup["bandwidths"]:
        if bw == "unlimited":
            continue
        rate = float(bw.replace("gbit", "e9").replace("mbit", "e6")) / 1e9
        layout = Layout(nodes=nodes, ranks_per_node=setup["ranks"] // nodes, inter_gbit=rate)
        for name, m in methods.items():
            if name not in sources:
                continue
            overhead = {name: unlimited[name] - unlimited[co]}
            row = predict({name: sources[name]}, shapes, layout, base[bw], schedule, overhead,
                          {name: m["payload_bytes_per_rank"]}, engine=engine)
            if not row:
                continue
            predicted, measured = row[0]["step_ms"], m["step_ms"][bw]
            rows.append({"method": name, "link": bw, "predicted_ms": round(predicted, 2), "measured_ms": measured,
                         "error": round(predicted / measured - 1, 3), "bytes_measured": row[0]["bytes_measured"],
                         "declared_bytes": None if row[0]["bytes_measured"] else round(
                             row[0]["bytes_per_step"] * schedule.steps),
                         "payload_bytes": m["payload_bytes_per_rank"]})
    return rows


# ----------------------------------------------------------------------------- CLI


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="commhooks plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn", help=f"{', '.join(MODELS)} or module:callable")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--inter-gbit", type=float, default=0.1, help="link between nodes, Gbit/s")
    p.add_argument("--intra-gbit", type=float, default=100.0, help="link inside a node, Gbit/s")
    p.add_argument("--latency-us", type=float, default=50.0, help="per collective step (TCP on a LAN: tens of us)")
    p.add_argument("--compute-ms", type=float, default=None, help="compute per step (ms); default: compute-only of --calibrate")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--peak-lr", type=float, default=0.003)
    p.add_argument("--config", help="comma-separated config files (JSON of any registered algorithm, a shipped "
                                    "config's name, or a DeepSpeed config with a comm_hook section): their rows "
                                    "and what a step and a sync send, with DDP's row for reference")
    p.add_argument("--import", dest="imports", default="", metavar="MODULE[,MODULE]",
                   help="modules to import first: those that register your own algorithms (register_algorithm)")
    p.add_argument("--declarations", action="store_true",
                   help="print what each config (--config, default: every shipped one) declares a step and a sync "
                        "send on --model and the cluster layout, as a markdown table (the docs include it)")
    p.add_argument("--engine", choices=ENGINES, default=DDP,
                   help="fsdp: FSDP2 shards the model over a node's ranks (its all-gathers and reduce-scatter there, "
                        "every step); the methods sync across nodes, DDP's row is FSDP2's own HSDP")
    p.add_argument("--replica-groups", action="store_true",
                   help="configs with replica groups: groups of a node's ranks, hierarchical syncs across nodes")
    p.add_argument("--calibrate", help="a commhooks bench results.json: method overheads and compute from it")
    p.add_argument("--methods", default=None, help="benchmark methods (default: every one whose bytes are declared "
                                                   "exactly; none when --config is given)")
    p.add_argument("--validate", metavar="RESULTS_JSON", help="compare predictions with a recorded benchmark")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    for module in (m for m in args.imports.split(",") if m):
        import importlib

        importlib.import_module(module)
    if args.validate:
        rows = validate(args.validate)
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print("| method | link | predicted ms/step | measured | error |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['method']} | {r['link']} | {r['predicted_ms']:.2f} | {r['measured_ms']:.2f} | {100 * r['error']:+.1f} % |")
        return 0
    shapes = model_shapes(args.model)
    schedule = Schedule(args.steps, args.warmup, args.peak_lr)
    layout = Layout(args.nodes, args.ranks_per_node, args.inter_gbit, args.intra_gbit, args.latency_us)
    from ..config import ConfigError

    if args.declarations:
        try:
            print(declarations_table(args.config.split(",") if args.config else None, shapes, schedule, layout,
                                     model_buffers(args.model)))
        except (ConfigError, KeyError) as exc:  # an unknown config, algorithm or key: say which
            p.error(str(exc).strip('"'))
        return 0
    overhead, compute = {}, args.compute_ms
    calibration = json.loads(open(args.calibrate).read())["methods"] if args.calibrate else None

    try:
        methods = _methods(args, schedule, shapes, layout)
    except (ConfigError, KeyError) as exc:  # an unknown config, algorithm or method: say which
        p.error(str(exc).strip('"'))
    if calibration:
        base = _compute_only(calibration)
        overhead = {k: v["step_ms"]["unlimited"] - base for k, v in calibration.items()}
        compute = base if compute is None else compute
    if compute is None:
        p.error("give --compute-ms (your model's step time without communication) or --calibrate")
    overrides = {"group_size": None, "hierarchical": True} if args.replica_groups else None
    try:
        rows = predict(methods, shapes, layout, compute, schedule, overhead, overrides=overrides,
                       buffers=model_buffers(args.model), engine=args.engine)
    except (ConfigError, KeyError) as exc:
        p.error(str(exc).strip('"'))
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "declared"} for r in rows], indent=1))
        return 0
    n = sum(math.prod(s) for _, s in shapes)
    print(f"{args.model}: {n / 1e6:.2f} M parameters{' sharded by FSDP2 in each node' if args.engine == FSDP else ''}; "
          f"{layout.nodes} nodes x {layout.ranks_per_node} ranks, "
          f"{layout.inter_gbit:g} Gbit/s between nodes, {layout.intra_gbit:g} inside; compute {compute:.2f} ms/step; "
          f"{schedule.steps} steps (predictions, not measurements)")
    print("| method | bytes/rank/step | between nodes | syncs | predicted ms/step | hidden by overlap | vs DDP | "
          "vs compute-only |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        speedup = "—" if r["speedup_vs_ddp"] is None else f"{r['speedup_vs_ddp']:.2f}x"
        how = " (measured)" if r["bytes_measured"] else " (bound)" if r["bytes_bound"] else ""
        syncs = "—" if not r["syncs"] else str(r["syncs"])
        hidden = f"{r['hidden_ms']:.1f} ms" if r["hidden_ms"] else "—"
        print(f"| {r['method']} | {r['bytes_per_step'] / 1e6:.3f} MB{how} | "
              f"{r['bytes_between_nodes_per_step'] / 1e6:.3f} MB | {syncs} | {r['step_ms']:.1f} | {hidden} | "
              f"{speedup} | {r['vs_compute_only']:.2f}x |")
    best = min((r for r in rows if methods[r["method"]].get("hook") != COMPUTE_ONLY), key=lambda r: r["step_ms"],
               default=None)
    if best is not None:
        print(f"\nfastest: {best['method']}, {best['step_ms']:.1f} ms/step predicted: {best['vs_compute_only']:.2f}x "
              f"compute-only's {compute:.1f} ms")
    for r in rows:
        if args.config and r["declared"] is not None and "config" in methods[r["method"]]:
            t = r["declared"]
            print(f"\n{r['method']} (rank 0): {t.syncs} syncs in {t.steps} steps; {t.bytes():,} B over the run"
                  + ("" if t.exact else f"; a bound: {t.note}"))
            print(describe(t))
    return 0


def _between(calls, layout: Layout, group: int = 1) -> int:
    """Bytes of ``calls`` that cross the nodes (a replica group larger than a node crosses them too)."""
    world = ("world", "group") if group > layout.ranks_per_node else ("world",)
    return sum(c.nbytes for c in calls if c.scope == "across" or c.scope in world and layout.nodes > 1)


def _where(calls, layout: Layout, bound: str = "", group: int = 1) -> str:
    """Bytes of ``calls`` by where they travel: between nodes, inside a node."""
    across = _between(calls, layout, group)
    inside = sum(c.nbytes for c in calls) - across
    parts = [f"{bound}{across:,} between nodes" if across else "", f"{bound}{inside:,} in the node" if inside else ""]
    return " + ".join(p for p in parts if p) or "0"


def declarations_table(paths: Optional[Sequence[str]], shapes: Shapes, schedule: Schedule, layout: Layout,
                       buffers: int = 0) -> str:
    """A markdown table of what each config declares (rank 0): bytes a step and a sync send, and where; syncs,
    bytes over the run between nodes and inside them, against DDP's.  ``paths=None``: every shipped config of a
    registered algorithm."""
    from .. import registry
    from ..shipped import shipped_configs

    if paths is None:
        paths = [str(p) for p in shipped_configs().values()]
    dense = _between(declared({"hook": DENSE}, shapes, schedule, layout, buffers=buffers).sends(), layout)
    lines = ["| config | type | a step sends (bytes) | a sync sends (bytes) | syncs | between nodes, run | "
             "in the node, run | between nodes vs DDP |", "|---|---|---|---|---|---|---|---|"]
    for path in paths:
        raw = read_config(path)
        if not isinstance(raw, dict) or raw.get("type") not in registry.names():
            continue
        t = declared({"config": raw, "label": path}, shapes, schedule, layout, buffers=buffers)
        if t is None:
            continue
        bound = "" if t.exact else "<= "
        between = _between(t.sends(), layout, t.group)
        lines.append(f"| {Path(path).stem} | {raw['type']} | {_where(t.step, layout, bound, t.group)} | "
                     f"{_where(t.sync, layout, bound, t.group)} | {t.syncs} | {bound}{between:,} | "
                     f"{bound}{t.bytes() - between:,} | {bound}{between / dense:.4f} |")
    return "\n".join(lines)


def _compute_only(calibration: dict) -> float:
    for name in calibration:
        try:
            if _bench().method_source(name).get("hook") == COMPUTE_ONLY:
                return calibration[name]["step_ms"]["unlimited"]
        except KeyError:
            continue
    raise SystemExit("--calibrate: the results hold no compute-only run")


def _methods(args, schedule, shapes, layout) -> Dict[str, dict]:
    """Label -> source of every row asked for: --config files (and DDP's baseline), --methods (benchmark names)."""
    out: Dict[str, dict] = {}
    names = args.methods.split(",") if args.methods else []
    if args.config:
        out[anchor_label(DENSE)] = {"hook": DENSE}
        for path in (x for x in args.config.split(",") if x):
            out[Path(path).stem] = {"config": path}
    elif not names:
        for name in (m for m in _bench().METHODS if m not in _bench().CONTROLS):
            source = _bench().method_source(name, args.model if args.model in ("cnn", "mlp", "gpt") else "cnn")
            t = declared(source, shapes, Schedule(min(schedule.steps, 60), schedule.warmup, schedule.peak_lr), layout,
                         engine=args.engine)
            if t is not None and t.exact:
                names.append(name)
    for name in (x for x in names if x):
        out[name] = _bench().method_source(name, args.model if args.model in ("cnn", "mlp", "gpt") else "cnn")
    return out
