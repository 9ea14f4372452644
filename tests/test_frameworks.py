"""commhooks inside the trainers people use, with the real packages: Hugging Face Accelerate and Trainer, PyTorch
Lightning (2 gloo ranks under torchrun, a 2-layer GPT-2 built from a config, synthetic tokens).

For each: QSR and AB, gradient accumulation 1 and 2, bf16 where the CPU allows; the ranks end identical; a resume
from the framework's own checkpoint is bit-exact, and one without commhooks' per-rank state is refused on every
rank; a NaN injected at step k is named at step k on every rank.  Accelerate against the same loop on plain DDP
(`commhooks.ddp.register`): equal.  The Trainer with a DeepSpeed bf16 ZeRO-2 config whose `comm_hook` section
QSR reads (no wrapper of the user's): identical ranks and an exact resume.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def torchrun(script: str, out: Path, *args: str, env=None, timeout: int = 600):
    out.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions"),
                **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(SCRIPTS / script), "--out", str(out), *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    ranks = []
    for r in range(2):
        f = out / f"rank{r}.json"
        assert f.exists(), f"{script} {args}: rank {r} wrote nothing (rc {proc.returncode}):\n" + proc.stderr[-3000:]
        ranks.append(json.loads(f.read_text()))
    return ranks, proc


def identical(ranks, steps):
    a, b = ranks
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    assert a["checksum"] == b["checksum"] and a["step"] == b["step"] == steps and a["syncs"] >= 2, (a, b)
    return a["checksum"]


def refused_everywhere(ranks, framework):
    for r in ranks:
        assert r.get("error", "").startswith("CheckpointError: " + framework + ": resuming"), r
        assert "lacks the per-rank state commhooks keeps" in r["error"], r["error"]


def nan_named_everywhere(ranks, step):
    for r in ranks:
        assert r.get("error", "").startswith("NonFiniteError: NaN or Inf gradient on 1 rank(s)"), r
    assert f"at optimizer step {step} on rank 0 in:" in ranks[0]["error"], ranks[0]["error"]
    assert "none on this rank (1)" in ranks[1]["error"], ranks[1]["error"]


def without_commhooks_state(checkpoint: Path, to: Path) -> None:
    shutil.copytree(checkpoint, to)
    shutil.rmtree(to / "commhooks")


# --------------------------------------------------------------------------
# Accelerate
# --------------------------------------------------------------------------

CPU = {"ACCELERATE_USE_CPU": "1"}


def test_accelerate(tmp_path):
    ab, _ = torchrun("accelerate_run.py", tmp_path / "ab", "--hook", "ab", "--accum", "2", "--save-at", "6", env=CPU)
    plain, _ = torchrun("accelerate_run.py", tmp_path / "plain", "--hook", "ab", "--accum", "2", "--plain", env=CPU)
    assert identical(ab, 12) == identical(plain, 12)  # the Accelerate loop is the plain DDP loop
    resumed, _ = torchrun("accelerate_run.py", tmp_path / "resumed", "--hook", "ab", "--accum", "2", "--resume-from",
                          str(tmp_path / "ab" / "ckpt"), env=CPU)
    assert identical(resumed, 12) == identical(ab, 12)  # bit-exact from accelerator.load_state
    without_commhooks_state(tmp_path / "ab" / "ckpt", tmp_path / "bare")
    refused, _ = torchrun("accelerate_run.py", tmp_path / "refused", "--hook", "ab", "--accum", "2", "--resume-from",
                          str(tmp_path / "bare"), env=CPU)
    refused_everywhere(refused, "Accelerate")
    qsr, _ = torchrun("accelerate_run.py", tmp_path / "qsr", "--hook", "qsr", "--bf16", env=CPU)
    identical(qsr, 12)
    nan, _ = torchrun("accelerate_run.py", tmp_path / "nan", "--hook", "qsr", "--nan-at", "4", env=CPU)
    nan_named_everywhere(nan, 4)
    none, _ = torchrun("accelerate_run.py", tmp_path / "none", "--hook", "none", "--steps", "4", "--save-at", "2",
                       env=CPU)  # {"type": "none"}: the same loop (with state:, save_state) on Accelerate's own DDP
    assert "error" not in none[0] and "error" not in none[1] and none[0]["checksum"] == none[1]["checksum"], none


# --------------------------------------------------------------------------
# Hugging Face Trainer
# --------------------------------------------------------------------------


def test_transformers_trainer(tmp_path):
    qsr, _ = torchrun("hf_trainer.py", tmp_path / "qsr", "--hook", "qsr", "--save-steps", "6", env=CPU)
    straight = identical(qsr, 12)
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "qsr" / "checkpoint-6", resumed_dir / "checkpoint-6")
    resumed, _ = torchrun("hf_trainer.py", resumed_dir, "--hook", "qsr", "--save-steps", "6", "--resume", env=CPU)
    assert identical(resumed, 12) == straight  # bit-exact from the Trainer's own checkpoint
    bare = tmp_path / "bare"
    bare.mkdir()
    without_commhooks_state(tmp_path / "qsr" / "checkpoint-6", bare / "checkpoint-6")
    refused, _ = torchrun("hf_trainer.py", bare, "--hook", "qsr", "--save-steps", "6", "--resume", env=CPU)
    refused_everywhere(refused, "Trainer")
    ab, _ = torchrun("hf_trainer.py", tmp_path / "ab", "--hook", "ab", "--accum", "2", "--bf16", env=CPU)
    identical(ab, 12)
    nan, _ = torchrun("hf_trainer.py", tmp_path / "nan", "--hook", "qsr", "--accum", "2", "--nan-at", "5", env=CPU)
    nan_named_everywhere(nan, 5)


def test_transformers_trainer_with_deepspeed_bf16_zero2(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "comm_hook": {"type": "qsr", "h_base": 3, "group_size": 1}}))
    first, _ = torchrun("hf_trainer.py", tmp_path / "run", "--deepspeed", str(ds), "--bf16", "--save-steps", "6")
    straight = identical(first, 12)
    checkpoint = tmp_path / "run" / "checkpoint-6"
    assert (checkpoint / "global_step6").is_dir() and (checkpoint / "replica1" / "global_step6").is_dir()
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(checkpoint, resumed_dir / "checkpoint-6")
    resumed, _ = torchrun("hf_trainer.py", resumed_dir, "--deepspeed", str(ds), "--bf16", "--save-steps", "6", "--resume")
    assert identical(resumed, 12) == straight


# --------------------------------------------------------------------------
# Lightning
# --------------------------------------------------------------------------


def test_lightning(tmp_path):
    ab, _ = torchrun("lightning_run.py", tmp_path / "ab", "--hook", "ab", "--save-every", "6")
    straight = identical(ab, 12)
    ckpt = tmp_path / "ab" / "ckpt" / "epoch=0-step=6.ckpt"
    resumed, _ = torchrun("lightning_run.py", tmp_path / "resumed", "--hook", "ab", "--save-every", "6",
                          "--resume", str(ckpt))
    assert identical(resumed, 12) == straight  # bit-exact from Lightning's own checkpoint (an epoch's end)
    shutil.rmtree(tmp_path / "ab" / "ckpt" / "commhooks")  # Lightning's file names where they were: gone
    refused, _ = torchrun("lightning_run.py", tmp_path / "refused", "--hook", "ab", "--save-every", "6",
                          "--resume", str(ckpt))
    refused_everywhere(refused, "Lightning")
    qsr, _ = torchrun("lightning_run.py", tmp_path / "qsr", "--hook", "qsr", "--accum", "2", "--bf16")
    identical(qsr, 12)
    nan, _ = torchrun("lightning_run.py", tmp_path / "nan", "--hook", "qsr", "--nan-at", "4")
    nan_named_everywhere(nan, 4)


@pytest.mark.parametrize("framework", ["accelerate", "transformers", "lightning"])
def test_the_integrations_import_only_their_framework(framework):
    """`import commhooks` pulls in no framework; each integration only its own."""
    code = (f"import sys, commhooks; assert not any(m in sys.modules for m in ('accelerate', 'transformers', "
            f"'lightning')); import commhooks.integrations.{framework}; print(sorted(m for m in ('accelerate', "
            f"'transformers', 'lightning') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
