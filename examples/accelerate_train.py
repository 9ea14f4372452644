"""A Hugging Face Accelerate loop with commhooks (the lines marked ``commhooks``).

    accelerate launch --num_processes 2 examples/accelerate_train.py                 # GPUs
    ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py   # CPUs
"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator

# --8<-- [start:accelerate]
import commhooks.integrations.accelerate                                        # commhooks

accelerator = Accelerator(gradient_accumulation_steps=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
model, optimizer = accelerator.prepare(model, optimizer)
state = commhooks.integrations.accelerate.register(                             # commhooks: the hook, and every
    accelerator, model, optimizer, {"type": "qsr", "h_base": 4, "alpha": 0.01})  # rank's state in save_state
with state:                                                                     # commhooks: ends with a sync
    for step in range(100):                                                     # your loop, unchanged
        with accelerator.accumulate(model):
            g = torch.Generator().manual_seed(1000 * step + accelerator.process_index)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            accelerator.backward(F.cross_entropy(model(x.to(accelerator.device)), y.to(accelerator.device)))
            optimizer.step()
            optimizer.zero_grad()
# --8<-- [end:accelerate]

print(f"rank {accelerator.process_index}: checksum {sum(float(p.detach().double().sum()) for p in model.parameters()):.10f}"
      f", {state.step} steps, {state.syncs} syncs, {state.report()['bytes_vs_allreduce']:.1%} of DDP's bytes", flush=True)
