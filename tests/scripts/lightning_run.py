"""A Lightning run with commhooks' callback: a small GPT-like model (a 2-layer GPT-2 from a config), synthetic
tokens, DDP on 2 CPU ranks under torchrun.

    torchrun --nproc_per_node 2 tests/scripts/lightning_run.py --out DIR --hook qsr [--accum 2] [--max-steps N]
        [--save-every K] [--resume CKPT] [--nan-at K] [--bf16] [--report DIR]

Each rank writes DIR/rank<r>.json: its parameter checksum, the hook's step and syncs, the error if any.
"""

import json
import os

import lightning as L
import torch
from framework_common import configs, parser, tiny_gpt2, tokens
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from commhooks.integrations.lightning import CommHookCallback

p = parser()
p.add_argument("--save-every", type=int, default=0)
p.add_argument("--resume")
p.add_argument("--save-top-k", type=int, default=-1)
p.add_argument("--report", help="the folder of this rank's JSON (default --out; two runs may share an --out)")
args = p.parse_args()

CONFIGS = configs()  # the callback fills total_steps from max_steps


class Tokens(torch.utils.data.Dataset):
    """48 sequences: an epoch is 6 batches of 4 per rank, so a checkpoint every 6 steps (accumulation 1 or 2) ends
    an epoch (Lightning resumes a plain DataLoader from the start of its epoch)."""

    def __len__(self):
        return 48

    def __getitem__(self, i):
        return tokens(i, args.data_offset)


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.gpt = tiny_gpt2()

    def training_step(self, ids, i):
        return self.gpt(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):  # a 4-step linear warm-up, stepped per step: the callback fills warmup_steps
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))  # peak from step 4
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warm, "interval": "step"}}

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Tokens(), batch_size=4, shuffle=False)


class InjectNaN(Callback):
    def __init__(self, at):
        self.at = at

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.at and trainer.global_rank == 0:
            for param in pl_module.parameters():
                if param.grad is not None:
                    param.grad.fill_(float("nan"))


hook = CommHookCallback(CONFIGS[args.hook])
callbacks = [InjectNaN(args.nan_at), hook] if args.nan_at >= 0 else [hook]  # the NaN goes in before the guard
if args.save_every:
    callbacks.append(ModelCheckpoint(dirpath=os.path.join(args.out, "ckpt"), every_n_train_steps=args.save_every,
                                     save_top_k=args.save_top_k, monitor="step" if args.save_top_k > 0 else None,
                                     mode="max"))
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.max_steps, callbacks=callbacks,
                    accumulate_grad_batches=args.accum, precision="bf16-mixed" if args.bf16 else "32",
                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=bool(args.save_every), default_root_dir=args.out)
model = Tiny()
result = {}
try:
    trainer.fit(model, ckpt_path=args.resume)
except Exception as exc:  # noqa: BLE001 - reported to the test
    result["error"] = f"{type(exc).__name__}: {exc}"
rank = trainer.global_rank
state = hook.state
result.update(rank=rank, checksum=float(sum(p.detach().double().sum() for p in model.parameters())),
              step=None if state is None else state.step, syncs=None if state is None else state.syncs,
              warmup=None if state is None else getattr(state.config, "warmup_steps", None))
with open(os.path.join(args.report or args.out, f"rank{rank}.json"), "w") as fd:
    json.dump(result, fd)
