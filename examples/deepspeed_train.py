"""A DeepSpeed training script with commhooks: the hook is the ``"comm_hook"`` section of the DeepSpeed JSON.

    deepspeed --num_gpus 2 examples/deepspeed_train.py --deepspeed_config configs/ds_qsr_bf16_zero2.json
    deepspeed --num_gpus 2 examples/deepspeed_train.py --deepspeed_config examples/ds_config.json
"""

import argparse

import torch
import torch.nn.functional as F

# --8<-- [start:deepspeed]
import commhooks.deepspeed                                                  # commhooks

parser = argparse.ArgumentParser()
parser.add_argument("--deepspeed_config", required=True)
parser.add_argument("--local_rank", type=int)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
engine, optimizer, _, _ = commhooks.deepspeed.initialize(                  # commhooks: was deepspeed.initialize(
    args=args, model=model, model_parameters=model.parameters())
dtype = next(engine.module.parameters()).dtype
with engine.comm_hook_state:                                               # commhooks: the run ends with a sync
    for step in range(60):                                                 # your loop, unchanged
        g = torch.Generator().manual_seed(1000 * step + engine.global_rank)
        x, y = torch.randn(engine.train_micro_batch_size_per_gpu(), 32, generator=g), torch.randint(0, 10, (
            engine.train_micro_batch_size_per_gpu(),), generator=g)
        loss = F.cross_entropy(engine(x.to(engine.device, dtype)).float(), y.to(engine.device))
        engine.backward(loss)
        engine.step()
# --8<-- [end:deepspeed]

state = engine.comm_hook_state
print(f"rank {engine.global_rank}: checksum {sum(float(p.detach().double().sum()) for p in model.parameters()):.6f}, "
      f"{state.step} steps, {state.syncs} syncs, {state.report()['bytes_vs_allreduce']:.1%} of DDP's bytes", flush=True)
