"""A PyTorch DDP training script with commhooks: the lines marked ``commhooks`` are all it takes.

    torchrun --standalone --nproc_per_node 2 examples/ddp.py [qsr|ab|outer-int8]

On a GPU host it trains on ``cuda:LOCAL_RANK`` over NCCL; here on the CPU over gloo.  It prints each rank's
parameter checksum at the end: the same on every rank (the run ends with a sync).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# --8<-- [start:import]
import commhooks
# --8<-- [end:import]

CONFIGS = {
    # --8<-- [start:configs]
    "qsr": {"type": "qsr", "alpha": 0.01, "h_base": 4, "warmup_steps": 20},
    "ab": {"type": "ab", "warmup_steps": 30, "sync_period": 20, "full_rank_steps": 2, "group_size": 1,
           "rank_cutoff": 0.8, "min_compression_rate": 1.5},
    "outer-int8": {"type": "qsr", "alpha": 0.01, "h_base": 8, "warmup_steps": 20, "outer_lr": 0.7,
                   "outer_momentum": 0.9, "payload": "int8", "error_feedback": True, "overlap_steps": 1},
    # --8<-- [end:configs]
}
config = CONFIGS[sys.argv[1] if len(sys.argv) > 1 else "qsr"]

cuda = torch.cuda.is_available()
local_rank = int(os.environ.get("LOCAL_RANK", 0))
if cuda:
    torch.cuda.set_device(local_rank)
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                            torch.nn.Linear(64, 10)).to(device)

# --8<-- [start:ddp]
ddp_model = DDP(model, device_ids=[device] if cuda else None,
                forward_sync_buffers=False)  # torch < 2.13: broadcast_buffers=False
optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=0.003, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / 200))

state = commhooks.ddp.register(ddp_model, optimizer, config)  # commhooks: the hook, for any algorithm
with state:                                                    # commhooks: the run ends with a sync
    for step in range(200):                                    # your loop, unchanged
        g = torch.Generator().manual_seed(1000 * step + rank)  # (each rank its own data)
        x = torch.randn(32, 32, generator=g).to(device)
        y = torch.randint(0, 10, (32,), generator=g).to(device)
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
        scheduler.step()
# --8<-- [end:ddp]

print(f"rank {rank}: checksum {sum(float(p.detach().double().sum()) for p in model.parameters()):.10f}, "
      f"{state.step} steps, {state.syncs} syncs, {state.report()['bytes_vs_allreduce']:.1%} of DDP's bytes", flush=True)
dist.destroy_process_group()
