"""A Hugging Face Trainer run with commhooks' callback: a 2-layer GPT-2 from a config, synthetic tokens, 2 ranks.

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 tests/scripts/hf_trainer.py --out DIR --hook qsr [--accum 2]
        [--max-steps N] [--save-steps K] [--resume] [--nan-at K] [--deepspeed ds.json] [--bf16]

Each rank writes DIR/rank<r>.json: its parameter checksum, the hook's step and syncs, the error if any.
"""

import json
import os

import torch
from framework_common import configs, parser, tiny_gpt2, tokens
from transformers import Trainer, TrainerCallback, TrainingArguments

from commhooks.integrations.transformers import CommHookCallback

p = parser()
p.add_argument("--save-steps", type=int, default=0)
p.add_argument("--resume", action="store_true")
p.add_argument("--resume-from", help="a checkpoint folder (resume_from_checkpoint=PATH), anywhere")
p.add_argument("--save-total-limit", type=int)
p.add_argument("--deepspeed")
p.add_argument("--local_rank", type=int)
args = p.parse_args()

CONFIGS = configs()  # the callback fills total_steps from max_steps


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 512

    def __getitem__(self, i):
        # under DeepSpeed on this CPU, Accelerate sees one process and shards nothing: each rank its own data
        ids = tokens(i, args.data_offset + (1000 * int(os.environ.get("RANK", 0)) if args.deepspeed else 0))
        return {"input_ids": ids, "labels": ids.clone()}


class InjectNaN(TrainerCallback):
    """NaN gradients on rank 0 at optimizer step ``at`` (after backward, before the optimizer step)."""

    def __init__(self, at):
        self.at = at

    def on_pre_optimizer_step(self, a, state, control, model=None, **kw):
        if state.global_step == self.at and int(os.environ.get("RANK", 0)) == 0:
            for param in model.parameters():
                if param.grad is not None:
                    param.grad.fill_(float("nan"))


model = tiny_gpt2()
targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=4, gradient_accumulation_steps=args.accum,
                          max_steps=args.max_steps, learning_rate=3e-3, warmup_steps=4, lr_scheduler_type="cosine",
                          save_steps=args.save_steps or args.max_steps + 1, save_strategy="steps" if args.save_steps else "no",
                          logging_steps=1000, report_to=[], use_cpu=not args.deepspeed, seed=0, data_seed=0,
                          dataloader_num_workers=0, deepspeed=args.deepspeed, bf16=args.bf16 and not args.deepspeed,
                          disable_tqdm=True, ddp_find_unused_parameters=False, save_total_limit=args.save_total_limit)
if args.deepspeed and args.bf16:
    # TrainingArguments refuses bf16 on a CPU unless use_cpu, which turns DeepSpeed off; DeepSpeed's CPU accelerator
    # runs bf16 (the suite's DeepSpeed tests do): set it after the check, for its "auto" bf16 section
    targs.bf16 = True
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    from accelerate.utils import DeepSpeedPlugin

    targs.hf_deepspeed_config = HfTrainerDeepSpeedConfig(args.deepspeed)  # its "auto" values read again, bf16 now
    targs.hf_deepspeed_config.trainer_config_process(targs)
    targs.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=targs.hf_deepspeed_config)  # as __post_init__ makes it
callbacks = [CommHookCallback(CONFIGS[args.hook])] if not args.deepspeed else [CommHookCallback(
    json.load(open(args.deepspeed))["comm_hook"])]
if args.nan_at >= 0:
    callbacks.append(InjectNaN(args.nan_at))
trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks)
rank = int(os.environ.get("RANK", 0))
result = {"rank": rank}
try:
    trainer.train(resume_from_checkpoint=args.resume_from or (True if args.resume else None))
except Exception as exc:  # noqa: BLE001 - reported to the test
    result["error"] = f"{type(exc).__name__}: {exc}"
hook = callbacks[0].state
engine = getattr(callbacks[0], "_deepspeed", None)
if engine is not None:
    result["engine_bf16"] = bool(engine.bfloat16_enabled())
    result["weight_dtype"] = str(next(engine.module.parameters()).dtype)
result.update(checksum=float(sum(p.detach().double().sum() for p in model.parameters())),
              step=None if hook is None else hook.step, syncs=None if hook is None else hook.syncs,
              warmup=None if hook is None else getattr(hook.config, "warmup_steps", None),
              total=None if hook is None else hook.config.total_steps,
              schedule=None if hook is None else hook.report()["schedule"],
              params={n: p.detach().float().flatten()[:8].tolist() for n, p in list(model.named_parameters())[:3]})
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fd:
    json.dump(result, fd)
