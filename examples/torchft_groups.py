"""Replica groups that drop out and heal while the others go on: commhooks' syncs through torchft.

One process per replica group, and a torchft Lighthouse (the ``torchft`` extra installs both)::

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 &      # prints its address, port 29510
    python examples/torchft_groups.py 0 http://localhost:29510 out/ &
    python examples/torchft_groups.py 1 http://localhost:29510 out/   # kill it, start it again: it heals

QSR with an outer step and int8 payloads with error feedback.  ``--die-at N``: SIGKILL itself after step N (what
tests/test_torchft.py does to group 1).  Each group writes its final weights and what it did to ``out/``.
"""

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo

import commhooks
import commhooks.torchft

STEPS, PACE_S = 240, 0.05  # paced so that a group restarted after a crash finds the other still training
# --8<-- [start:config]
CONFIG = {"type": "qsr", "alpha": 0.02, "h_base": 4, "warmup_steps": 10, "total_steps": STEPS, "outer_lr": 0.7,
          "outer_momentum": 0.5, "payload": "int8", "error_feedback": True, "payload_exchange": "allgather",
          "timeout_s": 30}
# --8<-- [end:config]

p = argparse.ArgumentParser()
p.add_argument("group", type=int)
p.add_argument("lighthouse")
p.add_argument("out")
p.add_argument("--die-at", type=int, default=None)
args = p.parse_args()

torch.manual_seed(100 + args.group)  # different starts on purpose: torchft's init_sync copies one group's
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, STEPS)

# --8<-- [start:live]
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # each replica group its own store
manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None,
                  min_replica_size=1, use_async_quorum=False, timeout=timedelta(seconds=10),
                  quorum_timeout=timedelta(seconds=90), rank=0, world_size=1, store_addr="127.0.0.1",
                  store_port=store.port, lighthouse_addr=args.lighthouse, replica_id=f"group{args.group}")
live = commhooks.torchft.register(model, optimizer, CONFIG, manager, scheduler)  # joins; heals if behind
joined_at, quorums = live.state.step, []
while live.state.step < STEPS:                  # a healed group goes on from its peers' step
    g = torch.Generator().manual_seed(1000 * live.state.step + args.group)  # each group its own data
    x, y = torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    syncs = live.state.syncs
    optimizer.step()                            # a sync, when due, goes to the groups of the current quorum
    scheduler.step()
    # --8<-- [end:live]
    if live.state.syncs != syncs:
        quorums.append([live.state.step, live.groups])
    if args.die_at is not None and live.state.step == args.die_at:
        print(f"group {args.group}: SIGKILL at step {live.state.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(PACE_S)
live.close()
manager.shutdown(wait=False)

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"group{args.group}.pt")
(out / f"group{args.group}.json").write_text(json.dumps({
    "joined_at": joined_at, "heals": live.heals, "retries": live.retries, "syncs": live.state.syncs,
    "sync_quorums": quorums, "step": live.state.step}))
print(f"group {args.group}: {live.state.step} steps, {live.state.syncs} syncs, healed {live.heals}x, "
      f"{live.retries} collective(s) retried", flush=True)
