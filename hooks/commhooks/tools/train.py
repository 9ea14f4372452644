"""Reference trainer: MNIST-1D (or, with ``--model gpt``, a byte-level GPT) across the ranks of whatever
launcher started it.

    torchrun --standalone --nproc_per_node 2 -m commhooks.tools.train --hook qsr --config configs/qsr_mnist1d.json
    deepspeed --num_gpus 2 --module commhooks.tools.train --backend deepspeed --deepspeed_config configs/ds_ab_mnist1d.json
    horovodrun -np 2 -H localhost:2 --gloo python -m commhooks.tools.train --backend horovod --hook ab --config configs/ab_mnist1d.json

Prints one summary line per run (rank 0) and, with ``--json-out``, writes it
as JSON for ``commhooks table``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import inspect
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from .. import config as cfg
from .. import ddp as ddp_adapter
from .. import registry
from ..checkpointer import Checkpointer
from ..comm import CollectiveError
from ..facts import launcher_local_world_size
from .anchors import ANCHORS, register_anchor
from .peers import PEERS
from . import live, provenance
from .fault_plan import PlannedFaults, ProgressFile
from ..algorithms.contract import AlgorithmState
from ..launch import LaunchError, init_distributed, local_cuda_index, shutdown
from .measure import PayloadCounter, iface_bytes
from .workloads import WORKLOADS, build_workload

HOOKS = ("none", *registry.names()) + ANCHORS + PEERS


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="commhooks train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", choices=HOOKS, default=None,
                   help="communication method: none = plain allreduce; " + ", ".join(registry.names()) + " = commhooks; "
                        "fp16, powersgd, local-sgd, compute-only = PyTorch's own, for comparison (DDP only); "
                        f"{', '.join(PEERS)} = torchft's own LocalSGD / DiLoCo (tools/peers.py); "
                        "default: the type of --config, else none")
    p.add_argument("--config", help="hook settings: JSON file (configs/...) with the fields of the hook's config")
    p.add_argument("--backend", choices=("ddp", "fsdp", "deepspeed", "horovod", "torchft"), default="ddp",
                   help="engine the hook plugs into; fsdp: FSDP2 shards the model inside each replica group of "
                        "--replica-group ranks (--hook none: FSDP2's own HSDP, an all-reduce across them every step); "
                        "torchft: this process is replica group RANK of WORLD_SIZE (or a rank of a group of several, "
                        "DDP inside it), its syncs through torchft (commhooks faults --torchft starts them)")
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"),
                   help="--backend torchft: the Lighthouse's address")
    p.add_argument("--quorum-timeout", type=float, default=300.0,
                   help="--backend torchft: seconds a group waits for a quorum (longer than a round)")
    p.add_argument("--replica-group", type=int, default=None,
                   help="--backend fsdp: ranks per replica group, over which FSDP2 shards (default: ranks per node)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model trains: cuda = cuda:LOCAL_RANK (NCCL; DDP with device_ids), cpu = gloo; "
                        "auto = cuda when a GPU is present")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   help="DeepSpeed JSON; its \"comm_hook\" section, if any, chooses the hook (--backend deepspeed)")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    p.add_argument("--model", choices=tuple(WORKLOADS), default="cnn",
                   help="cnn / mlp: MNIST-1D (quick); gpt: a ~2.4M-parameter byte-level GPT on Python source "
                        "(validation loss instead of accuracy)")
    p.add_argument("--context", type=int, default=64, help="--model gpt: bytes per sequence")
    p.add_argument("--clip", type=float, default=None,
                   help="gradient clipping (max global norm; default 1.0 for gpt, none for cnn/mlp; 0 = off)")
    p.add_argument("--autocast", choices=("auto", "bf16", "none"), default="auto",
                   help="bf16 autocast of the forward pass; auto = bf16 for gpt on CUDA only (this trainer's CPU "
                        "bf16 is ~12x slower than fp32 on CPUs without bf16 units)")
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps")
    p.add_argument("--stop-after", type=int, default=None,
                   help="run only the first N steps of the --steps schedule (the learning rate and the hook's "
                        "periods as in the full run): the benchmark's timing windows; the quality is then not the run's")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default 32; gpt 8 sequences)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 0.003; gpt 0.002)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD only")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--lr-warmup", type=int, default=50, help="linear lr warm-up steps before the cosine decay")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=42, help="seed of mnist1d.make_dataset")
    p.add_argument("--cache-dir", default=os.environ.get("COMMHOOKS_CACHE", ".cache"))
    p.add_argument("--json-out", help="write the summary as JSON here (rank 0; with {rank} in the path: every rank)")
    p.add_argument("--label", help="name of the run in the summary (default: the hook)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="--hook powersgd: matrix approximation rank")
    p.add_argument("--local-sgd-period", type=int, default=8, help="--hook local-sgd: PeriodicModelAverager period")
    p.add_argument("--peer-sync-every", type=int, help="--hook torchft-*: torchft's sync_every")
    p.add_argument("--peer-fragments", type=int, default=1, help="--hook torchft-diloco: model fragments (Streaming)")
    p.add_argument("--peer-delay", type=int, default=0, help="--hook torchft-diloco: fragment_sync_delay")
    p.add_argument("--peer-alpha", type=float, default=0.0, help="--hook torchft-diloco: fragment_update_alpha")
    p.add_argument("--anchor-start", type=int, default=50,
                   help="--hook powersgd / local-sgd: plain allreduce steps first (as the lr warm-up)")
    p.add_argument("--checkpoint-dir", help="save per-rank checkpoints here, and resume from the latest one at start")
    p.add_argument("--checkpoint-every", type=int, default=0, help="optimizer steps between checkpoints (0: none)")
    p.add_argument("--checkpoint-seconds", type=float, default=0.0,
                   help="seconds between checkpoints (0: none; with --checkpoint-every: whichever comes first)")
    p.add_argument("--resume", choices=("auto", "never"), default="auto",
                   help="with --checkpoint-dir: auto = go on from the newest complete checkpoint there, if any")
    p.add_argument("--fault-plan", help=argparse.SUPPRESS)  # commhooks.tools.faults: SIGKILL self at planned steps
    p.add_argument("--progress-file", help=argparse.SUPPRESS)  # commhooks.tools.faults: rank 0's step, about 1/s
    p.add_argument("--wire-iface", default=os.environ.get("COMMHOOKS_WIRE_IFACE"),
                   help="network interface whose tx/rx counters to report (the benchmark's veth)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--log-every", type=int, help="the hook's log_every: one line every N steps on rank 0 (0 = off)")
    args = p.parse_args(argv)
    for key, value in WORKLOADS[args.model].defaults.items():  # flags left unset: the workload's defaults
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be >= 1")
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        p.error(f"--stop-after must be from 1 to --steps ({args.steps}), got {args.stop_after}")
    if args.log_every is not None and args.log_every < 0:
        p.error(f"--log-every must be >= 0 (0 = off), got {args.log_every}")
    if args.hook in ANCHORS and args.backend != "ddp":
        p.error(f"--hook {args.hook} is PyTorch's own DDP hook: use --backend ddp")
    if args.hook in PEERS and (args.backend != "ddp" or not args.peer_sync_every or args.peer_sync_every < 1):
        p.error(f"--hook {args.hook} is torchft's own (each rank one replica, no engine): --backend ddp and "
                "--peer-sync-every N (N >= 1) are needed")
    if args.clip < 0:
        p.error(f"--clip must be >= 0 (0 = off), got {args.clip}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here (torch.cuda.is_available() is False); use --device cpu")
    if args.checkpoint_every < 0 or args.checkpoint_seconds < 0:
        p.error("--checkpoint-every and --checkpoint-seconds must be >= 0 (0 = off)")
    if (args.checkpoint_every or args.checkpoint_seconds) and not args.checkpoint_dir:
        p.error("--checkpoint-every / --checkpoint-seconds need --checkpoint-dir")
    if args.backend == "torchft" and not args.lighthouse:
        p.error("--backend torchft needs --lighthouse ADDRESS (or TORCHFT_LIGHTHOUSE): the torchft Lighthouse's")
    if args.backend == "torchft" and args.checkpoint_dir:
        p.error("--checkpoint-dir with --backend torchft: the trainer's live groups heal from each other instead")
    if args.backend == "fsdp" and args.checkpoint_dir:
        p.error("--checkpoint-dir with --backend fsdp: the trainer's checkpoints are per-rank files; FSDP2 runs "
                "save with commhooks.fsdp.save_checkpoint (DCP) in your script")
    if args.replica_group is not None and (args.backend != "fsdp" or args.replica_group < 1):
        p.error(f"--replica-group {args.replica_group}: a size >= 1, with --backend fsdp")
    if args.clip and args.backend == "horovod":
        p.error("--clip with --backend horovod: Horovod averages gradients inside optimizer.step(), after any "
                "clipping here; use --clip 0 (or --backend ddp / deepspeed)")
    return args


def cosine_with_warmup(optimizer, warmup: int, total: int):
    """Linear warm-up to the peak lr, then cosine decay to zero at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_optimizer(name: str, params, lr: float, momentum: float, weight_decay: float):
    """``params``: parameters or param groups (each group's own ``weight_decay`` wins)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def wrap_ddp(model, local_buffers: bool, one_bucket: bool = False) -> DDP:
    """DDP that, for local methods, does not re-broadcast buffers on every forward.

    ``one_bucket``: every gradient in a single bucket.  PyTorch's ``powerSGD_hook`` launches its second and
    third allreduce of a bucket from a future's callback; with two or more buckets on gloo those callbacks
    run in a different order on different ranks, so the ranks' collectives mismatch (gloo "Received data
    size doesn't match expected size", or a hang behind a slow link: seen with the 2.4M-parameter GPT,
    whose gradients fill DDP's 1 MiB first bucket and more).  An explicit ``bucket_cap_mb`` also sizes the
    first bucket, so one cap above the model's size gives one bucket."""
    kwargs = {}
    if one_bucket:
        size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        kwargs["bucket_cap_mb"] = math.ceil(size_mb) + 1
    if local_buffers:
        sig = inspect.signature(DDP.__init__).parameters
        kwargs["forward_sync_buffers" if "forward_sync_buffers" in sig else "broadcast_buffers"] = False
    device = next(model.parameters()).device
    if device.type == "cuda":
        kwargs["device_ids"] = [device]  # one GPU per process, as in PyTorch's DDP tutorial
    return DDP(model, **kwargs)


def hook_config(args):
    """The hook's config: the JSON file if given (its type names the hook when --hook is not given), else the
    hook's defaults; total_steps filled from --steps."""
    if args.hook is None:
        args.hook = "none" if args.config is None else None
    if args.hook == "none" or args.hook in ANCHORS or args.hook in PEERS:
        return None
    conf = cfg.load_config(args.config, kind=args.hook) if args.config else cfg.from_dict({}, kind=args.hook)
    if conf is None:
        raise cfg.ConfigError(f"--config {args.config} has type 'none': leave out --config or pass --hook none")
    args.hook = conf.kind
    return fill_total_steps(conf, args.steps, args.log_every)


def fill_total_steps(conf, steps: int, log_every: Optional[int] = None):
    """A config whose ``total_steps`` key is unset gets the run's length (a rule then never runs past the end);
    ``--log-every``, when given, sets ``log_every``."""
    if conf is not None and "total_steps" in type(conf).model_fields and conf.total_steps is None:
        conf.total_steps = steps
    if conf is not None and log_every is not None:
        conf.log_every = log_every
    return conf


def deepspeed_config(args, conf) -> dict:
    """The DeepSpeed config: the file's (whose ``comm_hook`` section wins), completed from the command line."""
    from .. import deepspeed as ds_adapter

    ds = ds_adapter.read_ds_config(args.deepspeed_config)
    ds.setdefault("train_micro_batch_size_per_gpu", args.batch_size)
    ds.setdefault("gradient_accumulation_steps", 1)
    ds.setdefault("gradient_clipping", args.clip)  # DeepSpeed's default is 1.0; --clip compares like with like
    ds["comm_hook"] = cfg.to_dict(conf)
    if conf is not None:
        ds_adapter.check_supported(ds)
    return ds


def resolve_hook(args):
    """The hook's config (validated before any collective, so every rank raises the same error)."""
    if args.backend == "deepspeed" and args.deepspeed_config:
        from ..deepspeed import read_ds_config

        section = read_ds_config(args.deepspeed_config).get("comm_hook")
        if section is not None:
            conf = cfg.load_config({"comm_hook": section})
            args.hook = "none" if conf is None else conf.kind
            return fill_total_steps(conf, args.steps, args.log_every)
    return hook_config(args)


def build_trainer(args, model, conf, workload):
    """(train_step, state, micro_batch, accumulation) for the chosen engine; train_step takes micro-batches."""
    micro, accumulation = args.batch_size, 1
    backward = lambda loss: loss.backward()  # noqa: E731

    def new_optimizer():
        groups = workload.param_groups(model, args.weight_decay)
        return build_optimizer(args.optimizer, groups, args.lr, args.momentum, args.weight_decay)

    if args.hook in PEERS:  # torchft's own classes around the bare model: each rank one replica
        from .peers import PeerRun

        optimizer = new_optimizer()
        state = PeerRun(args.hook, model, optimizer, args.peer_sync_every, args.peer_fragments, args.peer_delay,
                        args.peer_alpha)
        net, forward, step = model, model, lambda: optimizer.step()
    elif args.backend == "ddp":
        net = wrap_ddp(model, local_buffers=conf is not None, one_bucket=args.hook == "powersgd")
        optimizer = new_optimizer()
        if args.hook in ANCHORS:
            state = register_anchor(args.hook, net, optimizer, args.powersgd_rank, args.local_sgd_period, args.anchor_start)
        else:
            state = ddp_adapter.register(net, optimizer, conf)
        forward, step = net, lambda: optimizer.step()  # looked up late: the scheduler wraps it
    elif args.backend == "fsdp":
        net, optimizer, state = shard(model, conf, args.replica_group, new_optimizer)
        forward, step = net, lambda: optimizer.step()
    elif args.backend == "torchft":  # the scheduler first: a group that joins late heals it too
        optimizer = new_optimizer()
        scheduler = cosine_with_warmup(optimizer, args.lr_warmup, args.steps)
        net = wrap_ddp(model, local_buffers=True) if dist.is_initialized() else model  # a group of several ranks
        args.live = live.join(args, net, optimizer, scheduler, conf)
        state, forward, step = args.live.state, net, lambda: optimizer.step()
    elif args.backend == "horovod":
        import horovod.torch as hvd

        from .. import horovod as hvd_adapter

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd_adapter.DistributedOptimizer(
            new_optimizer(),
            named_parameters=model.named_parameters(), hook=conf, model=model)
        state = getattr(optimizer, "comm_hook_state", None)  # None: Horovod's own allreduce, unmetered
        forward, step = model, lambda: optimizer.step()
    else:
        from .. import deepspeed as ds_adapter

        # DeepSpeed JIT-compiles its ops on first use: keep them in the project's cache, not ~/.cache
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(args.cache_dir).resolve() / "torch_extensions"))
        ds = deepspeed_config(args, conf)
        optimizer = new_optimizer()
        engine, *_ = ds_adapter.initialize(model=model, optimizer=optimizer, config=ds)
        state = engine.comm_hook_state
        forward, backward, step = engine, engine.backward, engine.step
        micro, accumulation = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
    dtype = next(model.parameters()).dtype  # DeepSpeed bf16/fp16: the engine converted the model
    device = next(model.parameters()).device  # DeepSpeed moved it to its own device
    if args.backend != "torchft":
        scheduler = cosine_with_warmup(optimizer, args.lr_warmup, args.steps)
    if isinstance(state, AlgorithmState):
        scheduler = state.wrap_scheduler(scheduler)

    bf16 = args.autocast == "bf16" or (args.autocast == "auto" and workload.bf16_on_cuda and device.type == "cuda")

    def train_step(batches):
        """One optimizer step; returns (mean loss as a tensor on the device: read it only when needed, a host
        read stalls a GPU; the lr)."""
        losses = []
        if args.backend != "deepspeed":
            optimizer.zero_grad(set_to_none=True)
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):  # the model's device type
                out = forward(workload.inputs(x, dtype))
            loss = workload.loss(out, y)
            backward(loss)
            if args.backend == "deepspeed":
                step()  # DeepSpeed counts micro-steps; the boundary one updates (and clips: gradient_clipping)
            losses.append(loss.detach())
        if args.backend != "deepspeed":
            if args.clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            step()
        scheduler.step()
        return torch.stack(losses).mean(), scheduler.get_last_lr()[0]

    return train_step, state, micro, accumulation, optimizer, scheduler


def shard(model, conf, replica_group, new_optimizer):
    """FSDP2 on ``model``: each block, then the root, sharded over the replica group (ranks per node unless
    given); with a hook, over the shard dimension and the hook across the groups, without one over both
    dimensions (FSDP2's own HSDP, the baseline)."""
    from torch.distributed.fsdp import fully_shard

    from .. import fsdp as fsdp_adapter

    size = replica_group or launcher_local_world_size() or dist.get_world_size()
    mesh = fsdp_adapter.replica_mesh(size, next(model.parameters()).device.type)
    over = mesh if conf is None else mesh["shard"]
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=over)
    fully_shard(model, mesh=over)
    optimizer = new_optimizer()
    state = None if conf is None else fsdp_adapter.register(model, optimizer, conf)
    return model, optimizer, state


def start(args):
    """Bring up the backend's ranks: (rank, world, mean_over_ranks, finish)."""
    if args.backend == "torchft":  # no world: each group on its own (its own process group), its peers come and go
        group, groups, rank_in_group, group_size = live.placement()
        if group_size == 1:
            return group, groups, (lambda t: t), (lambda: None)
    if args.backend == "horovod":
        from .. import horovod as hvd_adapter

        hvd = hvd_adapter.init(resolve_hook(args))  # static process sets for the AB groups
        if args.device == "cuda":
            torch.cuda.set_device(local_cuda_index(hvd.local_rank(), local_world_size=hvd.local_size()))
        return hvd.rank(), hvd.size(), (lambda t: hvd.allreduce(t, op=hvd.Average, name="metric")), hvd.shutdown
    info = init_distributed(backend=None if args.device == "cuda" else "gloo")
    world = info["world_size"]

    def mean_over_ranks(t):
        dist.all_reduce(t)
        return t / world

    if args.backend == "torchft":  # a group of several ranks: its process group is the world here; the data shard
        return group * group_size + rank_in_group, groups * group_size, mean_over_ranks, shutdown  # the global one
    return info["rank"], world, mean_over_ranks, shutdown


def run(args: argparse.Namespace) -> dict:
    """Validate, start the ranks, train once, stop."""
    conf = resolve_hook(args)  # validate before any collective: every rank raises the same error
    rank, world, mean_over_ranks, finish = start(args)
    summary = train_once(args, rank, world, mean_over_ranks, conf)
    finish()
    return summary


def train_once(args: argparse.Namespace, rank: int, world: int, mean_over_ranks, conf=None) -> dict:
    """One training run on ranks that are already up (the benchmark runs several in one process group)."""
    conf = resolve_hook(args) if conf is None else conf
    torch.manual_seed(args.seed)
    workload = build_workload(args)
    model = workload.model()
    if args.device == "cuda" and args.backend != "deepspeed":  # DeepSpeed places the model itself
        model = model.to(torch.device("cuda", torch.cuda.current_device()))
    train_step, state, micro, accumulation, optimizer, scheduler = build_trainer(args, model, conf, workload)
    first_step, checkpointer = (state.step if args.backend == "torchft" else 0), None  # torchft: healed to a peer's
    faults = PlannedFaults(args.fault_plan, rank)
    if args.checkpoint_dir:
        checkpointer = Checkpointer(args.checkpoint_dir, model, optimizer, state, scheduler,
                                    every_steps=args.checkpoint_every, every_seconds=args.checkpoint_seconds,
                                    resume=args.resume, on_event=faults.on_event)
        first_step = checkpointer.start_step
        if checkpointer.resumed_from is not None and rank == 0:
            print(f"[commhooks] resumed from {args.checkpoint_dir} at step {first_step}", flush=True)
    progress_file = ProgressFile(args.progress_file if rank == 0 else None)

    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, desc=args.label or args.hook, leave=False, file=sys.stderr, mininterval=1.0)
    losses = []
    batches = workload.batches(micro, rank, world, args.seed, first_step * accumulation)
    wire_before = iface_bytes(args.wire_iface)
    counter = PayloadCounter()
    start = time.perf_counter()
    # the timed window: every step but the run's first (the process group's and DDP's one-off set-up, the same for
    # every method); its time, bytes and syncs are counted over the same steps (docs/pages/tools/measure.md: one window)
    last = args.steps if args.stop_after is None else args.stop_after  # a timing window: the schedule's first steps
    window_from = first_step + 1 if last - first_step > 1 else None
    window_start = window_end = None
    window_bytes = window_syncs = 0
    window_groups: dict = {}
    # every torch.distributed collective of the run, whoever issues it; `with state:` ends the run synced
    if args.hook in PEERS:
        state.counter = counter  # torchft's allreduces count as every method's collectives do
    with counter, (state if isinstance(state, AlgorithmState) or args.hook in PEERS else contextlib.nullcontext()):
        for step in range(first_step, last):
            if step == window_from:
                window_start = time.perf_counter()
                window_bytes, window_syncs = counter.bytes, getattr(state, "syncs", 0)
                window_groups = dict(counter.by_group)
            loss, lr = train_step([next(batches) for _ in range(accumulation)])
            losses.append(loss)
            del losses[:-50]  # the summary's train loss is the mean of the last 50
            faults.after_step(step + 1)
            progress_file.update(step + 1)
            if checkpointer is not None:
                checkpointer.after_step(step + 1)
            if progress is not None:
                progress.update(1)
                if step % 50 == 0:
                    progress.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.4f}")
        window_end = time.perf_counter()
        if checkpointer is not None:
            checkpointer.close()  # the last save is committed before the run ends
        progress_file.update(last, force=True)
    if args.backend == "torchft":
        live.leave(args.live)
    wall = time.perf_counter() - start
    wire_after = iface_bytes(args.wire_iface)
    if progress is not None:
        progress.close()

    device = next(model.parameters()).device
    tail = torch.stack(losses).mean().reshape(1).float() if losses else torch.zeros(1, device=device)
    tail = mean_over_ranks(tail.to(device))  # metric only, not hook traffic
    summary = {
        "label": args.label or args.hook,
        "hook": args.hook,
        "model": args.model,
        "ranks": world,
        "steps": args.steps,
        "steps_run": last - first_step,  # fewer than steps: a timing window (--stop-after) or a resumed run
        "test_acc": None,  # MNIST-1D; the GPT workload reports val_loss / val_ppl
        **workload.evaluate(model),
        "train_loss": round(tail.item(), 4),
        "backend": args.backend,
        "bytes_per_rank": state.meter.bytes() if hasattr(state, "meter") else None,  # commhooks' meter
        # what reached torch.distributed (all methods alike, DeepSpeed's own collectives included; not Horovod's)
        "payload_bytes_per_rank": counter.bytes if args.backend != "horovod" else None,
        "payload_bytes_by_group": {"-".join(map(str, g)): b for g, b in sorted(counter.by_group.items())}
        if args.backend != "horovod" else None,
        "wire_bytes_per_rank": None if wire_before is None else {k: wire_after[k] - wire_before[k] for k in wire_before},
        "step_ms": round(1000 * wall / max(1, last - first_step), 3),
        # the timed window (steps window[0]..window[1], counted from 1): its time per step, and the bytes and syncs
        # of the same steps, what the bench's paired ratios compare (None: a run of one step)
        "window": None if window_start is None else [window_from + 1, last],
        "steady_step_ms": None if window_start is None else
        round(1000 * (window_end - window_start) / (last - window_from), 3),
        "window_payload_bytes_per_rank": None if window_start is None or args.backend == "horovod" else
        counter.bytes - window_bytes,
        "window_payload_bytes_by_group": None if window_start is None or args.backend == "horovod" else
        {"-".join(map(str, g)): b - window_groups.get(g, 0) for g, b in sorted(counter.by_group.items())},
        "window_syncs": None if window_start is None or not isinstance(state, AlgorithmState) else
        state.syncs - window_syncs,
        "resumed_from": first_step,
        "params_checksum": float(sum(_whole(p).detach().double().sum() for p in model.parameters())),
        "params_sha256": params_sha256(model),  # equal only for bit-identical parameters
        "syncs": state.syncs if isinstance(state, AlgorithmState) or args.hook in PEERS else (
            None if args.hook in ANCHORS else last),
        "wall_s": round(wall, 2),
        "config": cfg.to_dict(conf),
        # the whole method: the hook and its arguments as well as the config (DDP, compute-only and PowerSGD all
        # run {"type": "none"}, and differ here)
        "method": method_spec(args, conf),
        "config_sha256": provenance.config_sha256(method_spec(args, conf)),
        **provenance.commit(),  # "one run, one commit": commhooks table refuses to mix commits
    }
    if isinstance(state, AlgorithmState):
        summary["report"] = state.report()
    if args.hook in PEERS:  # which torchft ran (the peer's own code)
        from importlib.metadata import version

        summary["peer_version"] = f"torchft {version('torchft')}"
    if args.backend == "torchft":  # what the live groups did: heals into this process, collectives retried
        summary.update(heals=args.live.heals, retries=args.live.retries, joined_at=first_step)
    if rank == 0:
        if isinstance(state, AlgorithmState):
            print(state.format_report(), flush=True)
        print(format_summary(summary), flush=True)
    if args.json_out and (rank == 0 or "{rank}" in args.json_out):  # "{rank}": one file per rank
        path = Path(args.json_out.format(rank=rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def method_spec(args, conf) -> dict:
    """What makes a method: its hook, the hook's own arguments, and its commhooks config."""
    own = {"powersgd": ("powersgd_rank", "anchor_start"), "local-sgd": ("local_sgd_period", "anchor_start"),
           "torchft-localsgd": ("peer_sync_every",),
           "torchft-diloco": ("peer_sync_every", "peer_fragments", "peer_delay", "peer_alpha")}
    return {"hook": args.hook, **{k: getattr(args, k) for k in own.get(args.hook, ())}, "config": cfg.to_dict(conf)}


def params_sha256(model) -> str:
    """A SHA-256 of every parameter's bytes, in order: two runs with the same one ended bit-identical."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(_whole(p).detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a whole tensor (an FSDP2 DTensor gathered: a collective every rank makes here)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def format_summary(s: dict) -> str:
    nbytes = "unmetered" if s["bytes_per_rank"] is None else f"{s['bytes_per_rank'] / 1e6:.2f}MB"
    return (
        f"[commhooks] {s['label']}: {quality(s)} train_loss={s['train_loss']:.4f} "
        f"bytes/rank={nbytes} syncs={s['syncs']} steps={s['steps']} "
        f"ranks={s['ranks']} wall={s['wall_s']:.1f}s"
    )


def quality(s: dict) -> str:
    """The run's quality figure: test accuracy (MNIST-1D) or validation loss and perplexity (GPT)."""
    if s.get("val_loss") is not None:
        return f"val_loss={s['val_loss']:.4f} val_ppl={s['val_ppl']:.3f}"
    return f"test_acc={s['test_acc']:.4f}"


def show_hook_log() -> None:
    """Print the hooks' INFO lines (``log_every``, DeepSpeed's filled-in keys) to stderr, prefixed like ours."""
    logger = logging.getLogger("commhooks")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[commhooks] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    show_hook_log()
    try:
        run(args)
    except cfg.ConfigError as exc:
        print(f"commhooks: config error: {exc}", file=sys.stderr, flush=True)
        return _exit_after_grace()
    except LaunchError as exc:
        print(f"commhooks: launch error: {exc}", file=sys.stderr, flush=True)
        return _exit_after_grace()
    except CollectiveError:
        # the process group is broken (a peer cut off, stopped or dead): tearing it down at exit can wait on the
        # lost peer or abort in a library's destructor (gloo's threads: "terminate called", exit -6 instead of
        # 1), so the rank prints its error and ends now; a launcher's restart takes it from the checkpoint
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    return 0


def _exit_after_grace() -> int:
    """Exit code 2, a moment late when there are peers: launchers kill the whole job as soon as one rank exits,
    which would hide the other ranks' (same) error messages. ``COMMHOOKS_ERROR_GRACE_S`` sets the delay."""
    if int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) or 1) > 1:
        time.sleep(float(os.environ.get("COMMHOOKS_ERROR_GRACE_S", "3")))
    return 2


if __name__ == "__main__":
    sys.exit(main())
