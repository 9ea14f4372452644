"""`commhooks plan`: bytes and step time of every method on a cluster larger than this machine, predicted.

Bytes come from exact per-method formulas (the ones the meter and the
benchmark's payload counter confirm on MNIST-1D; a test checks them against a
recorded benchmark); time from a latency-bandwidth model of the collectives:

* allreduce of ``B`` bytes over ``p = n g`` ranks on ``n`` nodes (a ring through
  every rank, as gloo and NCCL's rings run it: each node's link carries
  ``2 (p-1)/p B``): ``2 (p-1)/p * B / inter + calls * 2 (p-1) * latency``
  (on one node: the same over ``intra``);
* allgather of ``B`` bytes per rank (compressed payloads):
  ``(g-1) B / intra + (n-1) g B / inter + calls * latency``;
* replica groups (QSR ``group_size`` = ranks per node, DeepSpeed's ZeRO inside):
  the gradient allreduce stays inside the node, and each rank syncs a
  ``1/g`` shard across nodes (``g`` rings of ``n`` ranks side by side).

Links run at ``efficiency`` of their rate (TCP/IP over Ethernet frames carries
~94 % payload).  A step is ``compute + method overhead + communication``,
nothing overlapped (DDP overlaps part of its allreduce with backward, so DDP's
prediction errs long on fast links).  Method overhead (PowerSGD's
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
from typing import Dict, List, Optional, Sequence, Tuple

from ..algorithms.alignment import STEP_PROOF_BYTES as PROOF  # the step proof in every commhooks sync

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


MODELS = {"cnn": lambda: _torch_shapes("cnn"), "mlp": lambda: _torch_shapes("mlp"), "vgg16": _vgg16,
          "resnet50": _resnet50, "vit-b16": _vit_b16, "lm-1b": _lm_1b}


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
    """The run the byte formulas assume: steps, lr warm-up then cosine to zero (the trainer's), peak lr."""

    steps: int = 1200
    warmup: int = 50
    peak_lr: float = 0.003
    anchor_start: int = 50  # PowerSGD / post-local SGD: plain allreduce steps first

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def rule_syncs(config: dict, schedule: Schedule) -> int:
    """Syncs of a QSR config over ``schedule`` (the rule simulated round by round, as the state runs it)."""
    from ..algorithms.qsr import qsr_period
    from ..config import load_config

    conf = load_config({**config, "total_steps": schedule.steps})
    step, syncs = 0, 0
    while step < schedule.steps:
        step += qsr_period(step, schedule.lr(step), conf)
        syncs += 1
    return syncs


def powersgd_step_bytes(shapes: Shapes, rank: int, min_rate: float = 2.0) -> int:
    """torch's PowerSGD after its start iteration: P and Q of each compressible matrix, the rest uncompressed."""
    total = 0
    for _, shape in shapes:
        numel = math.prod(shape)
        if len(shape) > 1:
            m, n = shape[0], numel // shape[0]
            r = min(rank, m, n)
            if (m + n) * r * min_rate < m * n:
                total += (m + n) * r
                continue
        total += numel
    return 4 * total


@dataclass
class Traffic:
    """A method's average traffic per optimizer step: allreduce bytes (``world`` or ``node``-local) and
    allgather bytes per rank, collective calls, and whether its cross-node syncs are sharded per node."""

    allreduce: float = 0.0
    allreduce_intra: float = 0.0
    allgather: float = 0.0
    calls: float = 0.0
    sharded: bool = False
    measured: bool = False  # bytes taken from a benchmark, not from a formula

    @property
    def payload(self) -> float:
        return self.allreduce + self.allgather




def _config(path: str) -> dict:
    from ..config import read_json
    from ..shipped import find

    return read_json(find(path))


def method_traffic(method: str, shapes: Shapes, schedule: Schedule, group_size: int = 1,
                   proof: int = PROOF) -> Traffic:
    """Per-step traffic of ``method`` (benchmark names) from its formula."""
    n = sum(math.prod(s) for _, s in shapes)
    steps = schedule.steps
    if method == "ddp":
        return Traffic(allreduce=4 * n, calls=1)
    if method == "fp16":
        return Traffic(allreduce=2 * n, calls=1)
    if method.startswith("powersgd-r"):
        start = min(max(2, schedule.anchor_start), steps)
        per = powersgd_step_bytes(shapes, int(method[len("powersgd-r"):]))
        return Traffic(allreduce=(start * 4 * n + (steps - start) * per) / steps, calls=3)
    if method == "local-sgd-h8":
        start = min(schedule.anchor_start, steps)
        averages = math.ceil((steps - start) / 8)
        return Traffic(allreduce=(start * 4 * n + averages * 4 * n) / steps, calls=(start + averages) / steps)
    configs = {"qsr": "qsr_mnist1d", "qsr-int8": "qsr_int8_mnist1d", "qsr-diloco-int8": "qsr_diloco_int8_mnist1d",
               "diloco-h20": "diloco_mnist1d", "qsr-diloco-int4": "qsr_diloco_int4_mnist1d",
               "qsr-diloco-int2": "qsr_diloco_int2_mnist1d", "qsr-diloco-topk": "qsr_diloco_topk_mnist1d",
               "qsr-diloco": "qsr_diloco_mnist1d", "qsr-diloco-int2-nearest": "qsr_diloco_int2_nearest_mnist1d"}
    if method in configs:
        from ..algorithms import payload

        conf = _config(configs[method])
        syncs = rule_syncs(conf, schedule)
        codec = conf.get("payload", "fp32")
        outer = codec != "fp32" or conf.get("outer_lr", 1.0) != 1.0 or conf.get("outer_momentum", 0.0) != 0.0
        shard = math.ceil(n / group_size)
        body = proof + payload.Codec(codec, conf.get("payload_block", 256), conf.get("payload_rounding", "nearest"),
                                     conf.get("topk_density", 0.01), conf.get("topk_chunk", 4096),
                                     conf.get("topk_values", "fp32")).nbytes(shard)
        t = Traffic(calls=syncs / steps, sharded=group_size > 1)
        if group_size > 1:
            t.allreduce_intra = 4 * n  # the engine's data parallelism inside the node, every step
        anchor = 4 * shard / steps if outer else 0.0
        if codec == "fp32":
            t.allreduce = syncs * body / steps + anchor
        else:
            t.allgather, t.allreduce = syncs * body / steps, anchor
        return t
    if method == "compute-only":
        return Traffic()
    raise KeyError(method)


FORMULA_METHODS = ("ddp", "fp16", "powersgd-r1", "powersgd-r4", "local-sgd-h8", "qsr", "qsr-int8",
                   "qsr-diloco-int8", "qsr-diloco-int4", "qsr-diloco-int2", "qsr-diloco-topk", "diloco-h20",
                   "qsr-diloco", "qsr-diloco-int2-nearest", "compute-only")


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


def comm_ms(t: Traffic, layout: Layout) -> float:
    """Communication time per step (ms) of traffic ``t`` on ``layout``."""
    n, g = layout.nodes, layout.ranks_per_node
    inter = layout.inter_gbit * 1e9 / 8 * layout.efficiency  # bytes/s
    intra = layout.intra_gbit * 1e9 / 8 * layout.efficiency
    seconds = 0.0
    p = n * g
    if t.allreduce:
        if t.sharded:  # g rings of n ranks (one per shard), side by side on the node's link
            seconds += 2 * (n - 1) / n * g * t.allreduce / inter
        elif n > 1:  # one ring through every rank: each node's link carries 2 (p-1)/p of the payload
            seconds += 2 * (p - 1) / p * t.allreduce / inter
        else:
            seconds += 2 * (g - 1) / g * t.allreduce / intra
    if t.allreduce_intra:
        seconds += 2 * (g - 1) / g * t.allreduce_intra / intra
    if t.allgather:
        seconds += (n - 1) * g * t.allgather / inter + (g - 1) * t.allgather / intra
    ring = n if t.sharded else p
    seconds += t.calls * layout.latency_us * 1e-6 * 2 * (ring - 1)  # a ring's steps
    return 1000 * seconds


def predict(methods: Sequence[str], shapes: Shapes, layout: Layout, compute_ms: float, schedule: Schedule,
            overhead_ms: Optional[Dict[str, float]] = None, measured_bytes: Optional[Dict[str, float]] = None,
            group_size: int = 1) -> List[dict]:
    """One row per method: bytes per rank per step, predicted step time, speed-up against DDP."""
    rows = []
    for m in methods:
        if m in FORMULA_METHODS:
            t = method_traffic(m, shapes, schedule, group_size if m.startswith(("qsr", "diloco")) else 1)
        elif measured_bytes and m in measured_bytes:
            t = Traffic(allreduce=measured_bytes[m] / schedule.steps, calls=1, measured=True)
        else:
            continue
        step = compute_ms + (overhead_ms or {}).get(m, 0.0) + comm_ms(t, layout)
        rows.append({"method": m, "bytes_per_step": t.payload + t.allreduce_intra, "step_ms": step,
                     "bytes_measured": t.measured})
    ddp = next((r["step_ms"] for r in rows if r["method"] == "ddp"), None)
    for r in rows:
        r["speedup_vs_ddp"] = ddp / r["step_ms"] if ddp else None
    return rows


# ----------------------------------------------------------------------------- validation


def validate(bench_json: str) -> List[dict]:
    """Predicted vs measured step time for every method and limited link of a ``commhooks bench`` run.

    Calibration per method from the same run: compute-only's step time at each link (the machine's compute
    there) and the method's overhead on the unlimited link.  Bytes from the formulas (measured ones for
    methods without a formula, e.g. AB, whose ranks the data decides)."""
    data = json.loads(open(bench_json).read())
    setup, methods = data["setup"], data["methods"]
    shapes = model_shapes(setup["model"])
    schedule = Schedule(steps=setup["steps"])
    base = methods["compute-only"]["step_ms"]
    rows = []
    nodes = setup.get("nodes") or setup["ranks"]
    for bw in setup["bandwidths"]:
        if bw == "unlimited":
            continue
        rate = float(bw.replace("gbit", "e9").replace("mbit", "e6")) / 1e9
        layout = Layout(nodes=nodes, ranks_per_node=setup["ranks"] // nodes, inter_gbit=rate)
        for name, m in methods.items():
            overhead = {name: m["step_ms"]["unlimited"] - base["unlimited"]}
            row = predict([name], shapes, layout, base[bw], schedule, overhead,
                          {name: m["payload_bytes_per_rank"]})
            if not row:
                continue
            predicted, measured = row[0]["step_ms"], m["step_ms"][bw]
            rows.append({"method": name, "link": bw, "predicted_ms": round(predicted, 2), "measured_ms": measured,
                         "error": round(predicted / measured - 1, 3), "bytes_measured": row[0]["bytes_measured"],
                         "formula_bytes": None if row[0]["bytes_measured"] else round(row[0]["bytes_per_step"] * schedule.steps),
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
    p.add_argument("--replica-groups", action="store_true", help="QSR/DiLoCo across nodes, data parallel inside")
    p.add_argument("--calibrate", help="a commhooks bench results.json: method overheads and compute from it")
    p.add_argument("--methods", default=",".join(FORMULA_METHODS))
    p.add_argument("--validate", metavar="RESULTS_JSON", help="compare predictions with a recorded benchmark")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
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
    overhead, compute = {}, args.compute_ms
    if args.calibrate:
        data = json.loads(open(args.calibrate).read())
        base = data["methods"]["compute-only"]["step_ms"]["unlimited"]
        overhead = {k: v["step_ms"]["unlimited"] - base for k, v in data["methods"].items()}
        compute = base if compute is None else compute
    if compute is None:
        p.error("give --compute-ms (your model's step time without communication) or --calibrate")
    rows = predict([m for m in args.methods.split(",") if m], shapes, layout, compute, schedule, overhead,
                   group_size=args.ranks_per_node if args.replica_groups else 1)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    n = sum(math.prod(s) for _, s in shapes)
    print(f"{args.model}: {n / 1e6:.2f} M parameters; {layout.nodes} nodes x {layout.ranks_per_node} ranks, "
          f"{layout.inter_gbit:g} Gbit/s between nodes, {layout.intra_gbit:g} inside; compute {compute:.2f} ms/step "
          "(predictions, not measurements)")
    print("| method | bytes/rank/step | predicted ms/step | vs DDP |\n|---|---|---|---|")
    for r in rows:
        speedup = "—" if r["speedup_vs_ddp"] is None else f"{r['speedup_vs_ddp']:.2f}x"
        print(f"| {r['method']} | {r['bytes_per_step'] / 1e6:.3f} MB | {r['step_ms']:.1f} | {speedup} |")
    return 0
