"""DDP with commhooks and restarts that lose nothing: a checkpoint every 100 steps or 60 seconds (whichever comes
first), written off the training thread, and ``resume="auto"``, so that the same command line serves the first
start and every restart.

    torchrun --standalone --nproc_per_node 2 --max-restarts 3 examples/ddp_restarts.py

A rank killed at any point (torchrun then restarts every rank; SLURM's ``--requeue`` starts the job again) comes
back from the newest complete checkpoint in ``$OUT/ckpt`` and ends with the parameters of a run never killed.
Each rank prints its parameter checksum at the end, the same on every rank.

``commhooks.launch.init_distributed()``, not ``dist.init_process_group()``: torchrun's restarts reuse its agent's
store, and with the plain call a restarted rank can read the dead attempt's addresses (a hang in the rendezvous,
or gloo's "Connection refused" using up a restart); ``init_distributed`` keys each attempt apart.
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
import commhooks.launch

# --8<-- [start:init]
placement = commhooks.launch.init_distributed()  # nccl where CUDA is, else gloo; each restart keyed apart
# --8<-- [end:init]
local_rank = placement["local_rank"]
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
ddp_model = DDP(model, device_ids=[device] if device.type == "cuda" else None, forward_sync_buffers=False)
optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=0.003, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * (1 - s / 300))
state = commhooks.ddp.register(ddp_model, optimizer, {"type": "qsr", "alpha": 0.01, "h_base": 4, "warmup_steps": 20})

# --8<-- [start:restarts]
ckpt = commhooks.Checkpointer(os.path.join(os.environ.get("OUT", "."), "ckpt"), ddp_model, optimizer, state,
                              scheduler, every_steps=100, every_seconds=60)  # resume="auto": the newest complete one
with state:
    for step in range(ckpt.start_step, 300):                  # 0 on a fresh start, the saved step after a restart
        g = torch.Generator().manual_seed(1000 * step + rank)  # (each rank its own data, a function of the step)
        x, y = torch.randn(32, 32, generator=g).to(device), torch.randint(0, 10, (32,), generator=g).to(device)
        optimizer.zero_grad()
        F.cross_entropy(ddp_model(x), y).backward()
        optimizer.step()
        scheduler.step()
        ckpt.after_step()                                      # saves when due, on every rank alike
    ckpt.close()                                               # the last save committed (or its error raised)
# --8<-- [end:restarts]

print(f"rank {rank}: checksum {sum(float(p.detach().double().sum()) for p in model.parameters()):.10f}, "
      f"{state.step} steps, {state.syncs} syncs, {state.report()['bytes_vs_allreduce']:.1%} of DDP's bytes"
      + (f", resumed from step {ckpt.resumed_from}" if ckpt.resumed_from is not None else ""), flush=True)
dist.destroy_process_group()
