"""The Horovod adapter with the real Horovod build (PyTorch + Gloo), under horovodrun."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from commhooks.algorithms.alignment import STEP_PROOF_BYTES

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = str(REPO / "tests" / "scripts" / "hvd_equivalence.py")


def horovodrun(np, extra, out, hosts=True, timeout=400):
    horovodrun = BIN / "horovodrun"
    assert horovodrun.exists(), "horovodrun is missing: the Horovod build in .ci/install.sh failed"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_", "HOROVOD_"))}
    env.update(OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    cmd = [str(horovodrun), "-np", str(np)] + (["-H", f"localhost:{np}", "--gloo"] if hosts else [])
    cmd += [sys.executable, SCRIPT, "--out", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(np)]


def test_check_build_has_pytorch_and_gloo():
    proc = subprocess.run([str(BIN / "horovodrun"), "--check-build"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("PyTorch" in l and "[X]" in l for l in lines), proc.stdout
    assert any("Gloo" in l and "[X]" in l for l in lines), proc.stdout


def check(results):
    for r in results:
        for name, run in r["runs"].items():
            (w_ddp, b_ddp, s_ddp), (w_hvd, b_hvd, s_hvd) = run["ddp"], run["hvd"]
            for n in w_ddp:
                assert torch.allclose(w_ddp[n], w_hvd[n], atol=1e-5, rtol=1e-4), (name, n, (w_ddp[n] - w_hvd[n]).abs().max())
            assert b_ddp == b_hvd > 0, (name, b_ddp, b_hvd)  # the meter reads the same payload totals
            assert s_ddp == s_hvd == 12
        assert set(r["runs"]) == {"qsr", "ab-only-b", "ab-groups", "ab-groups-stale", "ab-x-qsr"}
        (w_ddp, b_ddp, _), (w_hvd, b_hvd, _) = r["passes2"]["ddp"], r["passes2"]["hvd"]
        for n in w_ddp:
            assert torch.allclose(w_ddp[n], w_hvd[n], atol=1e-5, rtol=1e-4), ("backward_passes_per_step=2", n)
        assert b_ddp == b_hvd
        assert r["errors"]["ddp"] == r["errors"]["hvd"] and "ab.rank_cutoff must be in (0.0, 1.0)" in r["errors"]["hvd"]
        assert r["plain_is_horovod"]
        check_toy(r["toy"], "hvd", 12)


def check_toy(toy, engine, steps):
    """The test-file algorithm ran through the adapter unchanged: same parameters and bytes as through DDP,
    and the same parameters as plain DDP (it is an every-step gradient mean)."""
    (w_ddp, b_ddp, s_ddp), (w_eng, b_eng, s_eng) = toy["ddp"], toy[engine]
    numel = sum(t.numel() for t in w_ddp.values())
    assert s_ddp == s_eng == steps
    # grads every step + params (and the step proof) every 3
    assert b_ddp == b_eng == 4 * numel * (steps + steps // 3) + STEP_PROOF_BYTES * (steps // 3), (b_ddp, b_eng)
    for n in w_ddp:
        assert torch.allclose(w_ddp[n], w_eng[n], atol=1e-5, rtol=1e-4), (engine, n)
        assert torch.allclose(w_ddp[n], toy["plain"][n], atol=1e-5, rtol=1e-4), ("plain DDP", n)


def test_two_ranks_gloo_host_list(tmp_path):
    check(horovodrun(2, [], tmp_path))


def test_two_ranks_without_host_list(tmp_path):
    check(horovodrun(2, [], tmp_path, hosts=False))


def test_four_ranks_process_sets(tmp_path):
    results = horovodrun(4, ["--group-size", "2"], tmp_path, timeout=600)
    assert results[0]["world"] == 4
    check(results)
