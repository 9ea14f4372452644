"""`make gpu-check`'s own logic, run on the CPU (COMMHOOKS_GPU_CHECK_ON_CPU=1) so the GPU check cannot rot
between the sessions that have a GPU: every check runs its CPU stand-in (gloo for cuda:gloo, small sizes) and
passes.  It proves nothing about GPUs; tests/gpu run on a GPU host does."""

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_its_logic_on_the_cpu(tmp_path):
    env = {**os.environ, "COMMHOOKS_GPU_CHECK_ON_CPU": "1", "GPU_CHECK_OUT": str(tmp_path),
           "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")}
    proc = subprocess.run(["bash", str(REPO / ".ci" / "gpu-check.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "gpu-check.jsonl").read_text().splitlines()]
    assert all(r["target"].startswith("CPU MODE") for r in rows), rows
    checks = {r["check"] for r in rows}
    assert {"two ranks on one device vs CPU", "four ranks, replica groups, hierarchical vs CPU",
            "GradScaler with an Inf on rank 1", "host syncs per step (commhooks code)",
            "memory per feature (x bf16 weight bytes)", "DeepSpeed bf16-zero2",
            "checkpoint round trip ab-mid-phase", "checkpoint round trip qsr-mid-overlap"} <= checks, checks
