"""Horovod under any launcher: QSR and AB through commhooks.horovod, one JSON line per rank.

    mpirun -np 2 python tests/scripts/hvd_launch.py --out DIR        (Open MPI; MPICH: mpiexec -n 2)
    horovodrun -np 2 -H localhost:2 --gloo python tests/scripts/hvd_launch.py --out DIR
    srun -n 2 python tests/scripts/hvd_launch.py --out DIR

Each rank prints {"rank", "size", "runs": {name: {"bytes", "syncs", "checksum"}}} and saves its final
parameters to DIR/rank<r>.pt, so a test can compare launchers.
"""

import argparse
import sys
import time
import json

import torch
import torch.nn.functional as F
from common import SGD, mlp

import commhooks.horovod

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=12)
args = p.parse_args()

RUNS = {
    "qsr": {"type": "qsr", "h_base": 3, "check_every": 1},
    "ab": {"type": "ab", "warmup_steps": 3, "sync_period": 6, "full_rank_steps": 1, "rank_cutoff": 0.4,
           "min_compression_rate": 0.0, "group_size": 1, "check_every": 1},
}
try:
    hvd = commhooks.horovod.init(RUNS["ab"])
except commhooks.launch.LaunchError as exc:  # as the trainer does: every rank says it before the launcher kills the job
    print(f"LaunchError: {exc}", file=sys.stderr, flush=True)
    time.sleep(3)
    sys.exit(1)
rank = hvd.rank()
result, params = {"rank": rank, "size": hvd.size(), "runs": {}}, {}
# AMP as Horovod documents it (synchronize, then scaler.step under skip_synchronize), one rank overflowing
RUNS["qsr-amp"] = {**RUNS["qsr"], "total_steps": args.steps}
RUNS["ab-amp"] = {**RUNS["ab"]}
for name, hook in RUNS.items():
    amp = name.endswith("-amp")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if amp else None
    model = mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = commhooks.horovod.DistributedOptimizer(torch.optim.SGD(model.parameters(), **SGD),
                                                 named_parameters=model.named_parameters(), hook=hook)
    if amp:
        opt.comm_hook_state.use_scaler(scaler)  # the syncs keep the ranks' scales equal
    for step in range(args.steps):
        g = torch.Generator().manual_seed(7919 * step + rank)
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.randn(8, 12, generator=g)), torch.randint(0, 3, (8,), generator=g))
        if not amp:
            loss.backward()
            opt.step()
            continue
        if rank == 1 and step in (4, 7):
            loss = loss * float("inf")  # rank 1 overflows twice
        scaler.scale(loss).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    state = opt.comm_hook_state
    params[name] = {n: t.detach().clone() for n, t in model.named_parameters()}
    result["runs"][name] = {"bytes": state.meter.bytes(), "syncs": state.syncs, "step": state.step,
                            "skipped": state.skipped_steps,
                            "checksum": float(sum(t.double().sum() for t in params[name].values()))}
torch.save(params, f"{args.out}/rank{rank}.pt")
print(json.dumps(result), flush=True)
hvd.barrier()
hvd.shutdown()
