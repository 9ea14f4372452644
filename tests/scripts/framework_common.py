"""What the framework scripts (accelerate_run.py, hf_trainer.py, lightning_run.py) share: the hook configs, the
model (a 2-layer GPT-2 built from a config, no download) and the synthetic tokens."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def parser(steps_flag: str = "--max-steps") -> argparse.ArgumentParser:
    """The options every framework script takes; each adds its own."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--hook", default="qsr", choices=("qsr", "ab", "none"))
    p.add_argument("--accum", type=int, default=1)
    p.add_argument(steps_flag, type=int, default=12)
    p.add_argument("--nan-at", type=int, default=-1, help="NaN gradients on rank 0 at this optimizer step")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--data-offset", type=int, default=0, help="another run: the same model, other data")
    return p


def configs(total_steps=None):
    """QSR (the rule over a short schedule) and AB (warm-up 3, a sync every 5, one full-rank step), as each test
    script uses them; ``total_steps`` where the script runs its own loop (the callbacks fill it)."""
    extra = {} if total_steps is None else {"total_steps": total_steps}
    return {
        "qsr": {"type": "qsr", "h_base": 3, "alpha": 0.002, **extra},
        "ab": {"type": "ab", "warmup_steps": 3, "sync_period": 5, "full_rank_steps": 1, "group_size": 1,
               "min_compression_rate": 1.01, "rank_cutoff": 0.5, **extra},
    }


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def tokens(i, offset=0):
    """Sequence ``i`` of the synthetic data: 16 token ids, the same on every run (``offset``: another run's)."""
    return torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i + offset))
