"""Quickstart: a PyTorch DDP script with commhooks' starting configuration, whole (imports included).

    torchrun --standalone --nproc_per_node 2 examples/quickstart.py

The README shows it line for line.  ``start_h4_int2`` is a shipped config: every rank trains alone for 4 steps,
then the ranks average their models, each sending its change in 2 bits per element with error feedback.  On
several nodes with several GPUs each, ``start_h4_int2_hier`` syncs across the nodes only.  The last line prints
each rank's parameter checksum (the same on every rank: the run ends with a sync), its steps and syncs, and its
bytes as a share of what DDP's gradient allreduce would have sent.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks

dist.init_process_group("gloo")  # "nccl" on GPUs, with DDP(..., device_ids=[local_rank])
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)

state = commhooks.ddp.register(model, optimizer, "start_h4_int2")  # commhooks: sync every 4 steps, in int2
with state:                                                        # commhooks: the run ends with a sync
    for step in range(200):                                        # your loop, unchanged
        x, y = torch.randn(32, 32), torch.randint(0, 10, (32,))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

report = state.report()
checksum = sum(p.double().sum().item() for p in model.parameters())
print(f"rank {dist.get_rank()}: checksum {checksum:.6f}, {report['step']} steps, {report['syncs']} syncs, "
      f"{100 * report['bytes_vs_allreduce']:.2f}% of DDP's bytes")
dist.destroy_process_group()
