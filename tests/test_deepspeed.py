"""The DeepSpeed adapter in a real DeepSpeed engine (CPU accelerator, gloo), under `deepspeed` and `torchrun`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_horovod import check_toy

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = str(REPO / "tests" / "scripts" / "ds_equivalence.py")


def launch(launcher, config, out, timeout=300):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    if launcher == "deepspeed":
        deepspeed = BIN / "deepspeed"
        assert deepspeed.exists(), "the deepspeed launcher is missing: the install step (commhooks[deepspeed]) failed"
        cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(29700 + os.getpid() % 200), SCRIPT]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT]
    cmd += ["--deepspeed_config", str(REPO / "configs" / config), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_same(a, b, what):
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-5, rtol=1e-4), f"{what}: {n} differs by {(a[n] - b[n]).abs().max()}"


@pytest.mark.parametrize("launcher, config", [("deepspeed", "ds_ab_mnist1d.json"), ("torchrun", "ds_qsr_mnist1d.json")])
def test_deepspeed_matches_ddp(launcher, config, tmp_path):
    results = launch(launcher, config, tmp_path)
    for r in results:
        for name, run in r["runs"].items():
            (w_ddp, bytes_ddp, steps_ddp), (w_ds, bytes_ds, steps_ds) = run["ddp"], run["ds"]
            assert_same(w_ddp, w_ds, f"{r['kind']} {name}")
            assert bytes_ddp == bytes_ds > 0, (name, bytes_ddp, bytes_ds)  # the meter reads the same payload
            assert steps_ddp == steps_ds == 14
        if r["kind"] == "ab":
            assert set(r["runs"]) == {"base", "only-b", "groups-stale", "ab-x-qsr"}
        (w_ns, b_ns, s_ns), (w_gas, b_gas, s_gas) = r["accumulation"]["ddp_no_sync"], r["accumulation"]["ds_gas2"]
        assert s_ns == s_gas == 14, "gradient accumulation must count optimizer steps"
        assert_same(w_ns, w_gas, "gradient_accumulation_steps=2 vs DDP no_sync")
        assert b_ns == b_gas
        if r["kind"] == "qsr":
            check_toy(r["toy"], "ds", 14)
        assert r["zero1"] is not None and "zero_optimization.stage 0, got 1" in r["zero1"]


def test_zero1_config_error_on_every_rank_without_hang(tmp_path):
    bad = tmp_path / "ds_zero1.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 1},'
                   ' "comm_hook": {"type": "qsr", "h_base": 2}}')
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "commhooks.tools.train",
         "--backend", "deepspeed", "--deepspeed_config", str(bad), "--steps", "3", "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("config error: comm_hook needs zero_optimization.stage 0, got 1") == 2, proc.stderr[-2000:]


def test_train_under_deepspeed_launcher(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    proc = subprocess.run(
        [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(29900 + os.getpid() % 90), "--module",
         "commhooks.tools.train", "--backend", "deepspeed", "--deepspeed_config", str(REPO / "configs" / "ds_ab_mnist1d.json"),
         "--steps", "230", "--no-progress"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[commhooks] ab: test_acc=" in proc.stdout and "AB report: step 230" in proc.stdout
