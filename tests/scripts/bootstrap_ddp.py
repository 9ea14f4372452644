"""Started by a real launcher (mpirun, mpiexec, srun by hand): bootstrap, train 3 DDP steps with a hook, report.

Prints one JSON line per rank: placement and a checksum of the parameters.
"""

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.launch import init_distributed, shutdown

placement = init_distributed(timeout=60)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
net = DDP(model, forward_sync_buffers=False)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
hook = sys.argv[1] if len(sys.argv) > 1 else "qsr"
config = {"type": "qsr", "h_base": 3} if hook == "qsr" else {"type": "ab", "warmup_steps": 1, "sync_period": 3,
                                                              "full_rank_steps": 0, "mode": "only-b"}
state = commhooks.ddp.register(net, opt, config)
g = torch.Generator().manual_seed(placement["rank"])
for _ in range(3):
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    opt.step()
flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
print(json.dumps({**placement, "checksum": flat.double().sum().item(), "norm": flat.norm().item(),
                  "bytes": state.meter.bytes()}), flush=True)
shutdown()
