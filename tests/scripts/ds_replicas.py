"""QSR replica groups inside real DeepSpeed engines (bf16/fp16, ZeRO 0-3), 4 ranks in groups of 2.

    torchrun --nproc_per_node 4 tests/scripts/ds_replicas.py --out DIR

Runs several engines in one process group (DeepSpeed is slow to start) and writes DIR/rank<r>.pt:
per run and step, whether the 4 ranks' weights are identical, identical inside the pair, the
collectives DeepSpeed and the hook issued (ranks, bytes), losses, and what the state counted.
"""

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import commhooks.deepspeed as ds_adapter
from commhooks.launch import init_distributed, shutdown
from commhooks.tools.measure import PayloadCounter

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--local_rank", type=int)
args = p.parse_args()

info = init_distributed(timeout=120)
rank, world = info["rank"], info["world_size"]
assert world == 4
PAIR = (0, 1) if rank < 2 else (2, 3)
TEACHER = torch.Generator().manual_seed(5)
W_TRUE = torch.randn(12, 3, generator=TEACHER)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))


def batch(step, size=32):
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(size, 12, generator=g)
    return x, (x @ W_TRUE).argmax(1)


def flat_weights(m):
    """The whole model (under ZeRO-3 its parameters are gathered for the read: a collective in the pair)."""
    import deepspeed

    params = list(m.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=any(hasattr(q, "ds_tensor") for q in params)):
        return torch.cat([q.detach().float().reshape(-1).clone() for q in params])


def agreement(m):
    """(all 4 ranks identical, identical inside my pair)."""
    mine = flat_weights(m)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return all(torch.equal(every[0], e) for e in every), torch.equal(every[PAIR[0]], every[PAIR[1]])


def run(precision, stage, steps, hook, overflow_at=None, scheduler=None, resume_at=None, ckpt=None):
    """Train ``steps`` optimizer steps; ``resume_at``: save there, rebuild the engine, load, go on."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    cfg = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**6,
           "comm_hook": hook}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000, "hysteresis": 1}
    if scheduler:
        cfg["scheduler"] = scheduler

    def build():
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
        engine, *_ = ds_adapter.initialize(model=m, optimizer=opt, config=copy.deepcopy(cfg))
        return m, engine

    m, engine = build()
    out = {"all_equal": [], "pair_equal": [], "losses": [], "lr": [], "calls": []}
    for step in range(steps):
        if resume_at is not None and step == resume_at:
            ds_adapter.save_checkpoint(engine, ckpt)  # no tag: each replica group's folder gets its 'latest'
            m, engine = build()
            path, _ = ds_adapter.load_checkpoint(engine, ckpt)
            assert path is not None and engine.comm_hook_state.step == resume_at
        x, y = batch(step)
        out["lr"].append(float(engine.get_lr()[0]))
        with PayloadCounter(log_calls=True) as seen:
            loss = F.cross_entropy(engine(x.to(dtype)).float(), y)
            if overflow_at == step and rank >= 2:
                loss = loss * float("inf")  # the second pair overflows, the first does not
            engine.backward(loss)
            engine.step()
        out["calls"].append(seen.log)
        out["losses"].append(float(loss) if torch.isfinite(loss) else None)
        a, pr = agreement(m)
        out["all_equal"].append(a)
        out["pair_equal"].append(pr)
    state = engine.comm_hook_state
    partition = sum(t.numel() for _, t in state.named_params)
    out.update(sync_steps=list(state.sync_steps), step=state.step, skipped=state.skipped_steps,
               ds_skipped=engine.skipped_steps, dp_world=engine.dp_world_size, partition_numel=partition,
               by_tag=state.meter.by_tag(), final=flat_weights(m), report=state.report(),
               mp_ranks=dist.get_process_group_ranks(engine.mpu.get_model_parallel_group()))
    return out


QSR = {"type": "qsr", "h_base": 3, "alpha": 0.0, "warmup_steps": 0, "total_steps": 12, "group_size": 2}
result = {"rank": rank}
for stage in (1, 2, 3):
    result[f"bf16_zero{stage}"] = run("bf16", stage, 12, QSR)
# the lr warms up, so a skipped scheduler step leaves the overflowing pair's lr behind: the rule's period differs
warm = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.05, "warmup_num_steps": 10,
                                      "warmup_type": "linear"}}
rule = {"type": "qsr", "h_base": 2, "alpha": 0.06, "warmup_steps": 4, "total_steps": 16, "group_size": 2}
for stage in (0, 2):  # DeepSpeed skips a bf16 step whose gradients overflow (check_grad_overflow, its default)
    result[f"bf16_zero{stage}_overflow"] = run("bf16", stage, 16, rule, overflow_at=3, scheduler=warm)
from deepspeed.accelerator import get_accelerator  # noqa: E402

if get_accelerator().is_fp16_supported():  # the loss scaler itself; DeepSpeed refuses fp16 on CPUs without it
    result["fp16_zero2_overflow"] = run("fp16", 2, 16, rule, overflow_at=3, scheduler=warm)
else:
    result["fp16_zero2_overflow"] = f"fp16 not supported by DeepSpeed's {get_accelerator().device_name()} accelerator here"
# training_data: DeepSpeed shards it over its data-parallel group (the pair); each rank must get its own share
dataset = torch.utils.data.TensorDataset(torch.arange(64))
net = model()
engine, _, loader, _ = ds_adapter.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                             training_data=dataset,
                                             config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {
                                                 "stage": 2}, "bf16": {"enabled": True}, "comm_hook": QSR,
                                                 "zero_allow_untested_optimizer": True})
result["data"] = sorted(int(i) for (batch,) in loader for i in batch)
straight = run("bf16", 2, 12, QSR)
resumed = run("bf16", 2, 12, QSR, resume_at=7, ckpt=f"{args.out}/ckpt")
result["resume"] = {"straight": straight["final"], "resumed": resumed["final"],
                    "sync_steps": (straight["sync_steps"], resumed["sync_steps"])}
resumed = run("bf16", 3, 12, QSR, resume_at=7, ckpt=f"{args.out}/ckpt3")  # ZeRO-3: the uninterrupted run is above
result["resume_zero3"] = {"straight": result["bf16_zero3"]["final"], "resumed": resumed["final"]}
# a script that seeds no model (DeepSpeedExamples' CIFAR): each rank starts from its own weights, and with replica
# groups of one rank DeepSpeed's start broadcast stays inside each; the state starts them from rank 0's
result["unseeded"] = {}
for stage in (0, 2):
    torch.manual_seed(1000 + rank)
    net = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3))
    before = agreement(net)[0]
    engine, *_ = ds_adapter.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), config={
        "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}, "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True, "comm_hook": {"type": "qsr", "h_base": 2, "group_size": 1,
                                                              "total_steps": 4}})
    masters = torch.cat([t.detach().float().reshape(-1) for _, t in engine.comm_hook_state.named_params])
    every = [torch.empty_like(masters) for _ in range(world)]
    dist.all_gather(every, masters)
    result["unseeded"][stage] = {"before": before, "after": agreement(engine.module)[0],
                                 "masters_equal": all(torch.equal(every[0], e) for e in every),
                                 "dp_world": engine.dp_world_size}
# a NaN gradient seen on one rank only (its NaN guard's record, as its observe() writes it at a step): the engine's
# own collective save_checkpoint is refused on every rank together, before anything is written
if rank == 3:
    engine.comm_hook_state.alignment.guard.observe([(0, torch.full((4,), float("nan")))], 0)
try:
    engine.save_checkpoint(f"{args.out}/nan")
    result["nan_save"] = "written"
except Exception as exc:  # noqa: BLE001 - reported to the test
    result["nan_save"] = f"{type(exc).__name__}: {exc}"
torch.save(result, f"{args.out}/rank{rank}.pt")
shutdown()
