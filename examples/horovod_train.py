"""A Horovod training script with commhooks (the lines marked ``commhooks``; the rest is Horovod's own recipe).

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_train.py
    mpirun -np 2 python examples/horovod_train.py          # also srun / torchrun: commhooks.horovod.init starts Gloo
"""

import torch
import torch.nn.functional as F

import horovod.torch as hvd
# --8<-- [start:horovod]
import commhooks.horovod                                          # commhooks

config = {"type": "qsr", "alpha": 0.01, "h_base": 4, "warmup_steps": 20}
commhooks.horovod.init(config)                                    # commhooks: was hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = commhooks.horovod.DistributedOptimizer(              # commhooks: was hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), hook=config)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for step in range(120):                                           # your loop, unchanged
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    x, y = torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
optimizer.comm_hook_state.finish()                                # commhooks: the run ends with a sync
# --8<-- [end:horovod]

state = optimizer.comm_hook_state
print(f"rank {hvd.rank()}: checksum {sum(float(p.detach().double().sum()) for p in model.parameters()):.10f}, "
      f"{state.step} steps, {state.syncs} syncs, {state.report()['bytes_vs_allreduce']:.1%} of DDP's bytes", flush=True)
hvd.shutdown()
