"""A PyTorch FSDP2 training script with commhooks: FSDP2 shards the model inside each replica group, commhooks
syncs the replica groups.  The lines marked ``commhooks`` are all it takes.

    torchrun --standalone --nproc_per_node 4 examples/fsdp_train.py             # 2 replica groups x 2 shards
    torchrun --standalone --nproc_per_node 4 examples/fsdp_train.py --resume    # again, from its checkpoint

The first run saves a DCP checkpoint after step 100 (under ``$OUT``, default ``checkpoints``); ``--resume``
loads it and trains the remaining steps: both end with the same checksum (the resume is exact).  On a GPU
host it trains on ``cuda:LOCAL_RANK`` over NCCL; here on the CPU over gloo.  Each rank prints the checksum of
the whole model at the end: the same on every rank (the run ends with a sync).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import commhooks  # commhooks

parser = argparse.ArgumentParser()
parser.add_argument("--group-size", type=int, default=2, help="ranks per replica group (FSDP2 shards over them)")
parser.add_argument("--resume", action="store_true", help="load the checkpoint of step 100 first")
args = parser.parse_args()
folder = os.path.join(os.environ.get("OUT", "checkpoints"), "fsdp-step-100")

cuda = torch.cuda.is_available()
local_rank = int(os.environ.get("LOCAL_RANK", 0))
if cuda:
    torch.cuda.set_device(local_rank)
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
rank = dist.get_rank()


class Net(nn.Module):
    def __init__(self, width=64, depth=4):
        super().__init__()
        self.embed = nn.Linear(32, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


torch.manual_seed(0)
model = Net().to(device)
config = {"type": "qsr", "alpha": 0.01, "h_base": 8, "warmup_steps": 20, "outer_lr": 0.7, "outer_momentum": 0.9,
          "payload": "int8", "error_feedback": True, "overlap_steps": 1}

# --8<-- [start:fsdp]
mesh = commhooks.fsdp.replica_mesh(args.group_size)            # commhooks: a (replicate, shard) mesh
for block in model.blocks:
    fully_shard(block, mesh=mesh["shard"])                     # FSDP2 inside each replica group
fully_shard(model, mesh=mesh["shard"])
optimizer = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / 200))

state = commhooks.fsdp.register(model, optimizer, config)     # commhooks: syncs across the replica groups
if args.resume:                                                # commhooks: DCP, with each rank's sync state
    commhooks.fsdp.load_checkpoint(folder, model, optimizer, state, scheduler)
with state:                                                    # commhooks: the run ends with a sync
    for step in range(state.step, 200):                        # your loop, unchanged
        g = torch.Generator().manual_seed(1000 * step + rank)  # (each rank its own data)
        x = torch.randn(32, 32, generator=g).to(device)
        y = torch.randint(0, 10, (32,), generator=g).to(device)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        if step + 1 == 100 and not args.resume:
            commhooks.fsdp.save_checkpoint(folder, model, optimizer, state, scheduler)
# --8<-- [end:fsdp]

checksum = sum(float(p.full_tensor().detach().double().sum()) for p in model.parameters())
print(f"rank {rank}: checksum {checksum:.10f}, {state.step} steps, {state.syncs} syncs, "
      f"{state.report()['bytes_vs_allreduce']:.1%} of DDP's bytes", flush=True)
dist.destroy_process_group()
