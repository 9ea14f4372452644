"""Horovod adapter vs DDP adapter, same model / seed / data / hook; run by horovodrun.

    horovodrun -np 2 -H localhost:2 --gloo python tests/scripts/hvd_equivalence.py --out DIR
    horovodrun -np 4 -H localhost:4 --gloo python tests/scripts/hvd_equivalence.py --out DIR --group-size 2

Each rank writes DIR/rank<r>.pt: for every hook variant the parameters and meter bytes of
both runs, backward_passes_per_step=2 vs DDP no_sync (summed, as Horovod sums), the
ConfigError both adapters give for a bad value, and whether the process sets were static.
"""

import argparse

import horovod.torch as hvd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import SGD, ddp_train, mlp, plain_ddp_train
from toy_algorithm import TOY
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
import commhooks.horovod
from commhooks.config import ConfigError
from commhooks.launch import init_distributed

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--group-size", type=int, default=1)
args = p.parse_args()

AB = {"type": "ab", "warmup_steps": 3, "sync_period": 5, "full_rank_steps": 1, "rank_cutoff": 0.4,
      "min_compression_rate": 0.0}
VARIANTS = {
    "qsr": {"type": "qsr", "h_base": 3, "warmup_steps": 2, "init_h": 1},
    # DiLoCo outer step with an int8 payload, in 2 fragments, each landing a step after it is sent: Horovod
    # carries the packed bytes by an allgather that stays in flight during the next step
    "qsr-int8-outer": {"type": "qsr", "h_base": 3, "warmup_steps": 2, "init_h": 1, "outer_lr": 0.7,
                       "outer_momentum": 0.9, "payload": "int8", "error_feedback": True, "overlap_steps": 1,
                       "fragments": 2},
    # replica groups whose ranks each sync their part across groups and share it inside the group (process
    # sets across the groups; a broadcast inside a process set); with 2 ranks (groups of 1) the key would act on
    # nothing, so it is left out (a config that sets it there is refused) and this is plain int8 averaging
    "qsr-hierarchical": {"type": "qsr", "h_base": 3, "warmup_steps": 2, "init_h": 1, "group_size": args.group_size,
                         "payload": "int8", "error_feedback": True, "overlap_steps": 1,
                         **({"hierarchical": True} if args.group_size > 1 else {})},
    # sparse payload (top-k per chunk, int4 values, stochastic rounding) with the period-aware outer step, averaged
    # by the two-step exchange (Horovod's alltoall, then its allgather) even on 2 ranks
    "qsr-topk-int4": {"type": "qsr", "h_base": 3, "warmup_steps": 2, "init_h": 1, "payload": "topk",
                      "topk_density": 0.1, "topk_chunk": 64, "topk_values": "int4", "payload_rounding": "stochastic",
                      "error_feedback": True, "outer_lr": 0.7, "outer_momentum": 0.9, "outer_normalize": "lr_sum",
                      "payload_exchange": "two_step"},
    "ab-only-b": {**AB, "mode": "only-b"},
    "ab-groups": {**AB, "mode": "groups", "group_size": args.group_size},
    "ab-groups-stale": {**AB, "mode": "groups", "group_size": args.group_size, "sync": "with-stale"},
    # AB x QSR whose syncs send int8 changes since the phase began (by allgather, as for QSR)
    "ab-x-qsr": {**AB, "mode": "groups", "group_size": args.group_size, "sync_rule": "qsr", "alpha": 0.1, "h_base": 3,
                 "payload": "int8"},
}
commhooks.horovod.init(list(VARIANTS.values()))  # static process sets for every variant's groups (of >= 2 ranks)
info = init_distributed(timeout=60)  # torch.distributed beside Horovod, for the DDP side
rank = hvd.rank()
assert info["rank"] == rank and info["world_size"] == hvd.size() and info["source"] == "horovod"


def batch(step, micro=0):
    g = torch.Generator().manual_seed(7919 * step + 31 * micro + rank)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def ddp_run(conf, passes):
    return ddp_train(conf, args.steps, batch, passes, mean_over_passes=False)  # Horovod sums the passes


NAMES = []  # every Horovod collective's name: stable names let Horovod's response cache hit
_real_allreduce_async_ = hvd.allreduce_async_


def _recording_allreduce_async_(tensor, *a, name=None, **kw):
    NAMES.append(name)
    return _real_allreduce_async_(tensor, *a, name=name, **kw)


hvd.allreduce_async_ = _recording_allreduce_async_


def hvd_run(conf, passes):
    m = mlp()
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    # Horovod's own examples pass compression and op explicitly, at these values
    opt = commhooks.horovod.DistributedOptimizer(torch.optim.SGD(m.parameters(), **SGD), named_parameters=m.named_parameters(),
                                                 hook=conf, backward_passes_per_step=passes,
                                                 compression=hvd.Compression.none, op=hvd.Average)
    assert isinstance(opt, torch.optim.SGD)
    for step in range(args.steps):
        opt.zero_grad()
        for mb in range(passes):
            x, y = batch(step, mb)
            F.cross_entropy(m(x), y).backward()
        opt.step()
    state = opt.comm_hook_state
    return {n: t.detach().clone() for n, t in m.named_parameters()}, state.meter.bytes(), state.step


result = {"world": hvd.size(), "rank": rank, "runs": {}}
for name, conf in VARIANTS.items():
    result["runs"][name] = {"ddp": ddp_run(conf, 1), "hvd": hvd_run(conf, 1)}
result["toy"] = {"ddp": ddp_run(TOY, 1), "hvd": hvd_run(TOY, 1), "plain": plain_ddp_train(args.steps, batch)}
result["passes2"] = {"ddp": ddp_run(VARIANTS["ab-groups"], 2), "hvd": hvd_run(VARIANTS["ab-groups"], 2)}



def opposite_hook_order():
    """Two same-shaped layers whose gradient hooks fire in opposite orders on even and odd ranks (each rank
    builds its graph in another order): each layer's gradient must be averaged with the same layer's, never
    with its twin.  Returns (the order the reductions started in, max |hooked update - true mean update|)."""
    torch.manual_seed(0)
    twins = torch.nn.ModuleDict({"a": torch.nn.Linear(6, 6), "b": torch.nn.Linear(6, 6)})
    hvd.broadcast_parameters(twins.state_dict(), root_rank=0)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    order = ("a", "b") if rank % 2 == 0 else ("b", "a")

    def loss():
        outs = {k: twins[k](x) for k in order}  # built in this rank's order: backward runs the other way
        return (outs["a"].pow(2).sum() + 3.0 * outs["b"].sum()) * (rank + 1)

    loss().backward()
    true_mean = {n: hvd.allreduce(p.grad.clone(), op=hvd.Average, name=f"reference.{n}") for n, p in
                 twins.named_parameters()}
    before = {n: p.detach().clone() for n, p in twins.named_parameters()}
    twins.zero_grad()
    opt = commhooks.horovod.DistributedOptimizer(
        torch.optim.SGD(twins.parameters(), lr=1.0), named_parameters=twins.named_parameters(),
        hook={"type": "qsr", "group_size": hvd.size(), "h_base": 100})  # one replica: gradients averaged each step
    started = []
    for n, p in twins.named_parameters():  # registered after the optimizer's own: sees the order they fire in
        p.register_post_accumulate_grad_hook(lambda p, n=n: started.append(n))
    loss().backward()
    opt.step()
    err = max(float((before[n] - p.detach() - true_mean[n]).abs().max()) for n, p in twins.named_parameters())
    return started, err


def fp16_mean():
    """A mean of fp16 tensors whose sum would overflow fp16 (65504): scaled before the sum."""
    from commhooks.comm.horovod_comm import HorovodComm

    t = torch.full((5,), 40960.0 + 1024.0 * rank, dtype=torch.float16)
    HorovodComm().allreduce([t], op="mean", tag="fp16-check")
    return t.float().tolist()


def train(m, opt, steps: int) -> None:
    """``steps`` steps of the script's loop: zero_grad, the step's batch, backward, step."""
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        F.cross_entropy(m(x), y).backward()
        opt.step()


def broadcast_optimizer_state_step():
    """Horovod's examples call hvd.broadcast_optimizer_state after building the optimizer: it steps once on zero
    gradients to create the state.  That is no training step: 6 training steps count 6, sync twice."""
    m = mlp()
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    opt = commhooks.horovod.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                                 named_parameters=m.named_parameters(),
                                                 hook={"type": "qsr", "h_base": 3, "total_steps": 6})
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    train(m, opt, 6)
    state = opt.comm_hook_state
    return state.step, state.syncs, state.meter.calls()


def horovods_own_order():
    """Horovod's own order (its docs, its synthetic benchmark): DistributedOptimizer, then broadcast_parameters and
    broadcast_optimizer_state, from weights each rank drew itself; and a script that broadcasts nothing.  Per run:
    commhooks' warnings about the start, the report's bytes and share of DDP's, a checksum after finish()."""
    import warnings

    out = {}
    for name, hook, broadcast in (("qsr", {"type": "qsr", "h_base": 3, "total_steps": 6}, True),
                                  ("ab", {**AB, "mode": "only-b", "warmup_steps": 0, "sync_period": 3}, True),  # bases at step 0
                                  ("no-broadcast", {"type": "qsr", "h_base": 3, "total_steps": 6}, False)):
        m = mlp()
        with torch.no_grad():  # each rank's own start, as an unseeded model gives
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)), alpha=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = commhooks.horovod.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                                         named_parameters=m.named_parameters(), hook=hook)
            if broadcast:
                hvd.broadcast_parameters(m.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(opt, root_rank=0)
            train(m, opt, 6)
            opt.comm_hook_state.finish()
        report = opt.comm_hook_state.report()
        out[name] = {"warned": [str(w.message) for w in caught if "weights" in str(w.message)
                                or "seed" in str(w.message)],
                     "bytes": report["bytes"], "share": report["bytes_vs_allreduce"],
                     "checksum": float(sum(p.detach().double().sum() for p in m.parameters()))}
    return out


result["broadcast_step"] = broadcast_optimizer_state_step()
result["own_order"] = horovods_own_order()
result["opposite_order"] = opposite_hook_order()
result["fp16_mean"] = fp16_mean()

bad = {"type": "ab", "rank_cutoff": 1.5}
errors = {}
for adapter, build in (
    ("ddp", lambda: commhooks.ddp.register(DDP(mlp()), torch.optim.SGD(mlp().parameters(), lr=0.1), bad)),
    ("hvd", lambda: commhooks.horovod.DistributedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), hook=bad)),
):
    try:
        build()
    except ConfigError as exc:
        errors[adapter] = str(exc)
result["errors"] = errors
try:
    commhooks.horovod.DistributedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), hook=VARIANTS["qsr"], op=hvd.Sum)
except ConfigError as exc:
    result["op_sum"] = str(exc)
result["names"] = (len(NAMES), len(set(NAMES)))
plain = commhooks.horovod.DistributedOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1), hook=None)
result["plain_is_horovod"] = hasattr(plain, "_allreduce_grad_async")  # Horovod's own wrapper
torch.save(result, f"{args.out}/rank{rank}.pt")
dist.barrier()
dist.destroy_process_group()
hvd.shutdown()
