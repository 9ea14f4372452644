"""DeepSpeed adapter vs DDP adapter, same model / seed / data / hook; run by `deepspeed` or `torchrun`.

    deepspeed --num_gpus 2 tests/scripts/ds_equivalence.py --deepspeed_config configs/ds_ab_mnist1d.json --out DIR
    torchrun --nproc_per_node 2 tests/scripts/ds_equivalence.py --deepspeed_config configs/ds_qsr_mnist1d.json --out DIR

The hook comes from the config's "comm_hook" section (an AB schedule is shortened to
fit the few steps). Each rank writes DIR/rank<r>.pt with the parameters of both runs,
their byte counts, the gradient-accumulation comparison and the ZeRO-1 error.
"""

import argparse
import copy
import json

import torch
import torch.nn.functional as F
from common import SGD, ddp_train, mlp, plain_ddp_train
from toy_algorithm import TOY

import commhooks.deepspeed as ds_adapter
from commhooks.config import ConfigError, load_config, to_dict
from commhooks.launch import init_distributed, shutdown

p = argparse.ArgumentParser()
p.add_argument("--deepspeed_config", required=True)
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=14)
p.add_argument("--local_rank", type=int)
args = p.parse_args()

info = init_distributed(timeout=60)
rank = info["rank"]
base = json.load(open(args.deepspeed_config))
hook = load_config(base)
if hook.kind == "ab":  # the shipped schedule is for 1200 steps: keep its settings, shorten the phases
    hook.warmup_steps, hook.sync_period, hook.full_rank_steps = 3, 5, 1
    hook.rank_cutoff, hook.min_compression_rate = 0.4, 0.0
else:
    hook.warmup_steps, hook.h_base, hook.total_steps = 2, 3, args.steps


def batch(step, micro=0, size=16):
    g = torch.Generator().manual_seed(7919 * step + 31 * micro + rank)
    return torch.randn(size, 12, generator=g), torch.randint(0, 3, (size,), generator=g)


def ddp_run(conf, micro_batches):
    return ddp_train(conf, args.steps, lambda step, m: batch(step, m, 16 // micro_batches), micro_batches)


def ds_run(conf, micro_batches, zero_stage=0, bf16=False):
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), **SGD)
    cfg = {**copy.deepcopy(base), "train_micro_batch_size_per_gpu": 16 // micro_batches,
           "gradient_accumulation_steps": micro_batches, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
           "comm_hook": to_dict(conf), "bf16": {"enabled": bf16}}
    engine, _, _, _ = ds_adapter.initialize(model=m, optimizer=opt, config=cfg)
    state = engine.comm_hook_state
    # replica groups: DeepSpeed's own allreduce runs inside the group (here the rank alone); otherwise it is off
    assert engine.config["comm_hook"] == to_dict(conf)
    assert engine.enable_backward_allreduce == state.engine.replica_data_parallel
    assert engine.dp_world_size == 1 or not state.engine.replica_data_parallel
    for step in range(args.steps):
        for mb in range(micro_batches):
            x, y = batch(step, mb, 16 // micro_batches)
            engine.backward(F.cross_entropy(engine(x.to(torch.bfloat16) if bf16 else x).float(), y))
            engine.step()
    state = engine.comm_hook_state
    return {n: t.detach().float().clone() for n, t in m.named_parameters()}, state.meter.bytes(), state.step


def ddp_autocast_run(conf):
    """DDP with fp32 weights and bf16 autocast: what the DeepSpeed bf16 run is compared with."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return ddp_run(conf, 1)


result = {"kind": hook.kind, "config": to_dict(hook), "runs": {}}
variants = {"base": hook}
if hook.kind == "qsr":  # DiLoCo outer step with a compressed payload, through the same contract
    variants["int8-outer"] = load_config({**to_dict(hook), "outer_lr": 0.7, "outer_momentum": 0.9, "payload": "int8",
                                          "error_feedback": True, "overlap_steps": 1, "fragments": 2})
    variants["bf16"] = load_config({**to_dict(hook), "payload": "bf16"})
    variants["int2-stochastic"] = load_config({**to_dict(hook), "payload": "int2", "payload_block": 64,
                                               "payload_rounding": "stochastic", "error_feedback": True,
                                               "payload_exchange": "two_step"})  # (all-to-all + allgather)
if hook.kind == "ab":
    variants["only-b"] = load_config({**{k: v for k, v in to_dict(hook).items() if k != "group_size"},
                                      "mode": "only-b"})  # (only-b's group is the world: no group_size)
    variants["groups-stale"] = load_config({**to_dict(hook), "mode": "groups", "group_size": 1, "sync": "with-stale"})
    variants["ab-x-qsr"] = load_config({**to_dict(hook), "sync_rule": "qsr", "alpha": 0.1, "h_base": 3,
                                        "payload": "int8", "payload_exchange": "two_step"})
for name, conf in variants.items():
    result["runs"][name] = {"ddp": ddp_run(conf, 1), "ds": ds_run(conf, 1)}
if hook.kind == "qsr":  # one launcher run proves the third, unknown algorithm too
    toy = load_config(TOY)
    result["toy"] = {"ddp": ddp_run(toy, 1), "ds": ds_run(toy, 1),
                     "plain": plain_ddp_train(args.steps, lambda step, m: batch(step, m, 16))}
if hook.kind == "ab":  # bf16 at ZeRO 0: the hook works on the fp32 masters; the initial weights for the error scale
    result["bf16"] = {"ddp_autocast": ddp_autocast_run(hook), "ds_bf16": ds_run(hook, 1, bf16=True),
                      "initial": {n: t.detach().clone() for n, t in mlp().named_parameters()}}
if hook.kind == "ab":  # bf16 at ZeRO 0 with DeepSpeed's own Adam / AdamW (one flat fp32 master) vs a torch AdamW
    flat = {}
    conf = load_config({**to_dict(hook), "total_steps": args.steps})
    for name in ("Adam", "AdamW", "client"):
        m = mlp()
        cfg = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 0.0, "bf16": {"enabled": True},
               "zero_optimization": {"stage": 0}, "comm_hook": to_dict(conf)}
        if name == "client":
            engine, _, _, _ = ds_adapter.initialize(model=m, config=cfg, optimizer=torch.optim.AdamW(
                m.parameters(), lr=1e-3, weight_decay=0.01))
        else:
            cfg["optimizer"] = {"type": name, "params": {"lr": 1e-3, "weight_decay": 0.01}}
            engine, _, _, _ = ds_adapter.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        for step in range(args.steps):
            x, y = batch(step)
            engine.backward(F.cross_entropy(engine(x.to(torch.bfloat16)).float(), y))
            engine.step()
        report = engine.comm_hook_state.report()
        flat[name] = {"wrapper": type(engine.optimizer).__name__, "syncs": report["syncs"],
                      "ranks": {layer["name"]: layer["rank"] for layer in report["layers"]},
                      "params": {n: t.detach().float().clone() for n, t in m.named_parameters()}}
    result["flat_master"] = flat
result["accumulation"] = {"ddp_no_sync": ddp_run(hook, 2), "ds_gas2": ds_run(hook, 2)}
if hook.kind == "qsr":  # DeepSpeedExamples' CIFAR batch settings: the global batch stays the user's
    batches = {}
    for name, keys in {"tbs16": {"train_batch_size": 16}, "tbs16-gas2": {"train_batch_size": 16,
                                                                          "gradient_accumulation_steps": 2},
                       "tbs15": {"train_batch_size": 15}}.items():
        cfg = {"steps_per_print": 2000, **keys, "zero_allow_untested_optimizer": True, "comm_hook": to_dict(hook)}
        m = mlp()
        try:
            engine, _, _, _ = ds_adapter.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), **SGD), config=cfg)
            batches[name] = (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                             engine.dp_world_size)
        except ConfigError as exc:
            batches[name] = str(exc)
    result["batches"] = batches
try:  # QSR (replica groups of one rank: nothing to shard) equals stage 0; AB is refused before any collective
    result["zero1"] = ds_run(hook, 1, zero_stage=1)
except ConfigError as exc:
    result["zero1"] = str(exc)
torch.save(result, f"{args.out}/rank{rank}.pt")
shutdown()
