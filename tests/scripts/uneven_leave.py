"""Uneven inputs without Join, under torchrun: rank 0 has 10 batches, rank 1 has 14; rank 0's process ends after
its last step.  Rank 1 must stop with an error naming the collective and saying that a peer left, never train on
alone with its own gradients as if they were the mean.

    torchrun --standalone --nproc_per_node 2 tests/scripts/uneven_leave.py qsr|ab
"""

import sys

import torch
import torch.distributed as dist

import commhooks
import commhooks.launch

commhooks.launch.init_distributed()
rank = dist.get_rank()
torch.manual_seed(0)
net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
config = {"qsr": {"type": "qsr", "h_base": 4, "timeout_s": 20},  # syncs every 4 steps
          "ab": {"type": "ab", "warmup_steps": 20, "sync_period": 30, "full_rank_steps": 2, "group_size": 1,
                 "timeout_s": 20}}[sys.argv[1]]  # warm-up: DDP's gradient mean every step, through the hook
state = commhooks.ddp.register(net, opt, config)
for step in range(10 if rank == 0 else 14):
    opt.zero_grad()
    net(torch.randn(4, 8)).sum().backward()
    opt.step()
print(f"rank {rank}: finished {state.step} steps", flush=True)
