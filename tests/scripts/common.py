"""What the cross-backend scripts share: the model, and the DDP side of each comparison."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks

SGD = dict(lr=0.05, momentum=0.9, weight_decay=0.01)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def ddp_train(conf, steps, batch, passes=1, mean_over_passes=True):
    """Train the MLP through the DDP adapter; ``passes`` micro-batches per step under ``no_sync()``.

    ``mean_over_passes``: scale each micro-batch loss by 1/passes (DeepSpeed's
    gradient accumulation) or not (Horovod's backward_passes_per_step sums).
    Returns (parameters, meter bytes, optimizer steps counted by the hook).
    """
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), **SGD)
    state = commhooks.ddp.register(net, opt, conf)
    scale = 1.0 / passes if mean_over_passes else 1.0
    for step in range(steps):
        opt.zero_grad()
        for m in range(passes):
            x, y = batch(step, m)
            if m < passes - 1:
                with net.no_sync():  # forward and backward inside: DDP decides in forward whether to sync
                    (F.cross_entropy(net(x), y) * scale).backward()
            else:
                (F.cross_entropy(net(x), y) * scale).backward()
        opt.step()
    return {n: t.detach().clone() for n, t in net.module.named_parameters()}, state.meter.bytes(), state.step


def plain_ddp_train(steps, batch):
    """The MLP under plain DDP, no hook: what an every-step gradient mean must reproduce."""
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), **SGD)
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step, 0)
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return {n: t.detach().clone() for n, t in net.module.named_parameters()}
