"""A Hugging Face Trainer run with commhooks: one callback (the line marked ``commhooks``).

    torchrun --standalone --nproc_per_node 2 examples/transformers_trainer.py
    (on CPUs: ACCELERATE_USE_CPU=1 torchrun ...)
"""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

# --8<-- [start:trainer]
from commhooks.integrations.transformers import CommHookCallback                 # commhooks


class Tokens(torch.utils.data.Dataset):  # your data set
    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
args = TrainingArguments(output_dir=os.environ.get("OUT", "results/trainer-example"), max_steps=30,
                         per_device_train_batch_size=4, learning_rate=3e-3, warmup_steps=5, report_to=[],
                         save_strategy="no", use_cpu=not torch.cuda.is_available())
hook = CommHookCallback({"type": "qsr", "h_base": 4, "alpha": 0.01})            # commhooks
trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[hook])
trainer.train()
# --8<-- [end:trainer]

print(f"rank {int(os.environ.get('RANK', 0))}: checksum {sum(float(p.detach().double().sum()) for p in model.parameters()):.10f}"
      f", {hook.state.step} steps, {hook.state.syncs} syncs, {hook.state.report()['bytes_vs_allreduce']:.1%} of DDP's bytes",
      flush=True)
