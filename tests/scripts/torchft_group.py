"""One replica group (one process) of tests/test_torchft.py: QSR with an outer step and int8 payloads with error
feedback, its syncs through torchft; ``--die-at N``: SIGKILL itself after local step N (mid-round).

    python tests/scripts/torchft_group.py GROUP LIGHTHOUSE OUT [--die-at N]
"""

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests.test_ab's model and batches

import commhooks  # noqa: E402
import commhooks.torchft  # noqa: E402
from tests.test_ab import batch, mlp  # noqa: E402

STEPS, PACE_S = 240, 0.05  # paced so the other group is still training when this one comes back
CONFIG = dict(type="qsr", alpha=0.02, h_base=4, warmup_steps=10, total_steps=STEPS, outer_lr=0.7,
              outer_momentum=0.5, payload="int8", error_feedback=True, payload_exchange="allgather", timeout_s=30)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("group", type=int)
    p.add_argument("lighthouse")
    p.add_argument("out")
    p.add_argument("--die-at", type=int, default=None)
    args = p.parse_args()
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    torch.manual_seed(100 + args.group)  # different starts: torchft's init_sync copies one group's to the other
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's own store
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None,
                      min_replica_size=1, use_async_quorum=False, timeout=timedelta(seconds=10),
                      quorum_timeout=timedelta(seconds=90), connect_timeout=timedelta(seconds=10), rank=0,
                      world_size=1, store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
                      replica_id=f"group{args.group}")
    live = commhooks.torchft.register(model, opt, CONFIG, manager, sched)
    joined_at, quorums = live.state.step, []
    while live.state.step < STEPS:
        step = live.state.step
        x, y = batch(step, args.group)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        syncs = live.state.syncs
        opt.step()
        sched.step()
        if live.state.syncs != syncs:
            quorums.append([live.state.step, live.groups])
        if args.die_at is not None and live.state.step == args.die_at:
            print(f"group {args.group}: SIGKILL at step {live.state.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(PACE_S)
    live.close()
    out = Path(args.out)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"group{args.group}.pt")
    (out / f"group{args.group}.json").write_text(json.dumps({
        "joined_at": joined_at, "heals": live.heals, "retries": live.retries, "syncs": live.state.syncs,
        "sync_quorums": quorums, "step": live.state.step}))
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
