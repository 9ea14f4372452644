"""Replica groups that drop out and heal while the others go on: commhooks' syncs through torchft.

A torchft Lighthouse (the ``torchft`` extra installs it), then each replica group started on its own: one process,
or several under ``torchrun`` with DDP or FSDP2 inside the group (torchrun restarts the whole group when one of
its ranks dies, as torchtitan's groups do)::

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 &      # prints its address, port 29510
    torchrun --standalone --nproc_per_node 2 --max-restarts 3 examples/torchft_groups.py 0 http://localhost:29510 out/ --groups 2 &
    torchrun --standalone --nproc_per_node 2 --max-restarts 3 examples/torchft_groups.py 1 http://localhost:29510 out/ --groups 2

Every group has the same number of ranks; groups of one process need no torchrun (``python
examples/torchft_groups.py 0 ...``).  ``--groups N``: a first start waits for N groups before its first step (under
``--min_replicas 1`` the first group up would otherwise train alone until the others join and heal from it).

QSR with an outer step and int8 payloads with error feedback; ``--inner fsdp`` shards the model inside each group
with FSDP2 instead of DDP.  Rank i of a group syncs with rank i of the others (torchft's Manager per rank); each
group is seeded apart on purpose (torchft's ``init_sync`` gives every group the first group's weights, every rank of
a group from the same group).
``--checkpoints DIR``: each group saves under ``DIR/group<g>`` every 50 steps; a start of the whole job resumes from
there.  ``--die-at N``: rank ``--die-rank`` SIGKILLs itself in step N + 1, after the gradients' mean inside the group and
before the optimizer's step (and the step's sync), in the group's first start only (what tests/test_torchft.py does
to group 1: at a sync, its other rank then syncs with the live group while the dead rank's counterpart cannot).  Each rank writes its final weights and what it did to ``out/``.
"""

import argparse
import hashlib
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchft import Manager, ProcessGroupGloo

import commhooks
import commhooks.launch
import commhooks.torchft

STEPS, PACE_S = 240, 0.05  # paced so that a group restarted after a crash finds the others still training
# --8<-- [start:config]
CONFIG = {"type": "qsr", "alpha": 0.02, "h_base": 4, "warmup_steps": 10, "total_steps": STEPS, "outer_lr": 0.7,
          "outer_momentum": 0.5, "payload": "int8", "error_feedback": True, "timeout_s": 30}
# --8<-- [end:config]

p = argparse.ArgumentParser()
p.add_argument("group", type=int)
p.add_argument("lighthouse")
p.add_argument("out")
p.add_argument("--inner", choices=["ddp", "fsdp"], default="ddp")
p.add_argument("--die-at", type=int, default=None)
p.add_argument("--die-rank", type=int, default=0)
p.add_argument("--checkpoints", default=None, help="a folder: each group saves under it every 50 steps, and a start "
               "of the whole job resumes every group from the newest step all of them committed")
p.add_argument("--pace", type=float, default=PACE_S)
p.add_argument("--groups", type=int, default=None, help="a first start waits for this many groups before its first "
               "step (a run that does not depend on which group started first)")
p.add_argument("--h-base", type=int, default=None, help="another h_base than the others' (a config that differs)")
args = p.parse_args()
if args.h_base is not None:
    CONFIG["h_base"] = args.h_base

# --8<-- [start:group]
# the replica group's own process group (under torchrun: every start keyed apart), and a store for its Managers
# made new at each start (torchrun's own store keeps a dead start's keys, such as the old Manager's address)
if "RANK" in os.environ:
    commhooks.launch.init_distributed()
rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
store, host, port = commhooks.launch.fresh_store()  # hosted by the group's rank 0; host and port on every rank

torch.manual_seed(100 + args.group)  # different starts per group on purpose: torchft's init_sync copies one group's
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
if size > 1 and args.inner == "fsdp":
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer)
    model = fully_shard(model)                  # sharded over the group's ranks: rank i syncs its shards
elif size > 1:
    model = torch.nn.parallel.DistributedDataParallel(model)  # averaged inside the group every step
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)
# --8<-- [end:group]



def digest() -> str:
    """This rank's parameters (FSDP2: its shards), hashed: a healed rank starts from its live counterpart's."""
    local = [getattr(t, "to_local", lambda: t)().detach().contiguous() for t in model.parameters()]
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in local)).hexdigest()[:16]


# --8<-- [start:live]
manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None,
                  min_replica_size=1, use_async_quorum=False, timeout=timedelta(seconds=10),
                  quorum_timeout=timedelta(seconds=90), rank=rank, world_size=size, store_addr=host,
                  store_port=port, lighthouse_addr=args.lighthouse, replica_id=f"group{args.group}")
ckpt = None if args.checkpoints is None else os.path.join(args.checkpoints, f"group{args.group}")  # a group's own
live = commhooks.torchft.register(model, optimizer, CONFIG, manager, scheduler,  # joins; heals if behind
                                  checkpoint_dir=ckpt, checkpoint_every=50, wait_for_groups=args.groups)
joined_at, joined_with, quorums = live.state.step, digest(), []


def die(*_):  # --die-at N: inside step N + 1, once its gradients are averaged, before the step and its sync
    if live.state.step == args.die_at and rank == args.die_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                                                      "0") == "0":
        print(f"group {args.group} rank {rank}: SIGKILL at step {live.state.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


optimizer.register_step_pre_hook(die)
while live.state.step < STEPS:                  # a healed group goes on from its peers' step
    g = torch.Generator().manual_seed(1000 * live.state.step + 10 * args.group + rank)  # each rank its own data
    x, y = torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    syncs = live.state.syncs
    optimizer.step()                            # a sync, when due, goes to the groups of the current quorum
    scheduler.step()
    live.after_step()                           # with checkpoint_dir: saves when due
    # --8<-- [end:live]
    if live.state.syncs != syncs:
        quorums.append([live.state.step, live.groups, digest()])
    time.sleep(args.pace)
live.close()
manager.shutdown(wait=False)

weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
           for k, v in getattr(model, "module", model).state_dict().items()}  # FSDP2: gathered inside the group
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
torch.save(weights, out / f"group{args.group}.rank{rank}.pt")
(out / f"group{args.group}.rank{rank}.json").write_text(json.dumps({
    "resumed_from": live.resumed_from, "joined_at": joined_at, "joined_with": joined_with, "heals": live.heals,
    "healed_from": (live.healed_from or "").split(":")[0], "retries": live.retries, "syncs": live.state.syncs,
    "sync_quorums": quorums, "step": live.state.step,
    "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}))
print(f"group {args.group} rank {rank}: {live.state.step} steps, {live.state.syncs} syncs, healed {live.heals}x, "
      f"{live.retries} collective(s) retried", flush=True)
if size > 1:
    commhooks.launch.shutdown()
