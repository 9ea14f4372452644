"""A PyTorch Lightning run with commhooks: one callback (the line marked ``commhooks``).

    python examples/lightning_train.py                  # Lightning starts the 2 processes itself
    torchrun --standalone --nproc_per_node 2 examples/lightning_train.py
"""

import lightning as L
import torch
import torch.nn.functional as F

# --8<-- [start:lightning]
from commhooks.integrations.lightning import CommHookCallback                   # commhooks


class Net(L.LightningModule):  # your LightningModule
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.003)


g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(640, 32, generator=g), torch.randint(0, 10, (640,), generator=g))
hook = CommHookCallback({"type": "qsr", "h_base": 4, "alpha": 0.01})           # commhooks
trainer = L.Trainer(accelerator="auto", devices=2, strategy="ddp", max_steps=40, callbacks=[hook],
                    logger=False, enable_checkpointing=False, enable_progress_bar=False)
model = Net()
trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=16))
# --8<-- [end:lightning]

print(f"rank {trainer.global_rank}: checksum {sum(float(p.detach().double().sum()) for p in model.parameters()):.10f}"
      f", {hook.state.step} steps, {hook.state.syncs} syncs, {hook.state.report()['bytes_vs_allreduce']:.1%} of DDP's bytes",
      flush=True)
