"""`commhooks train` under real torchrun with 2 ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

from commhooks.algorithms.contract import STEP_PROOF_BYTES

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def torchrun(args, tmp_path, timeout=180):
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    return subprocess.run(
        TORCHRUN + ["-m", "commhooks.tools.train", "--no-progress", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )


def test_train_qsr_and_baseline_summaries(tmp_path):
    runs = {}
    for hook, extra in (("none", []), ("qsr", ["--config", str(REPO / "configs/qsr_mnist1d.json")])):
        out = tmp_path / f"{hook}.json"
        proc = torchrun(["--hook", hook, "--steps", "60", "--json-out", str(out), *extra], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"[commhooks] {hook}: test_acc=" in proc.stdout
        runs[hook] = json.loads(out.read_text())
    ddp, qsr = runs["none"], runs["qsr"]
    assert ddp["syncs"] == 60 and ddp["bytes_per_rank"] % 60 == 0
    per_step = ddp["bytes_per_rank"] // 60  # one gradient-sized payload per step
    # one parameter-sized payload per sync, and the step it proves
    assert qsr["bytes_per_rank"] == qsr["syncs"] * (per_step + STEP_PROOF_BYTES)
    assert qsr["syncs"] < 60 and qsr["config"]["total_steps"] == 60
    table = subprocess.run(
        [sys.executable, "-m", "commhooks.cli", "table", str(tmp_path / "none.json"), str(tmp_path / "qsr.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert "| qsr |" in table.stdout and "| none |" in table.stdout
    assert len(qsr["commit"]) == 40 and qsr["commit"] == ddp["commit"] and len(qsr["config_sha256"]) == 16
    assert f"All runs: commit {qsr['commit'][:7]}" in table.stdout and "unlimited loopback" in table.stdout
    # one run, one commit: a summary of another commit is refused, naming the files and the way to allow it
    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(qsr, commit="0" * 40, label="other")))
    args = [sys.executable, "-m", "commhooks.cli", "table", str(tmp_path / "none.json"), str(other)]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "2 commits" in refused.stderr and "--mixed" in refused.stderr, refused.stderr
    assert "other.json" in refused.stderr and refused.stdout == ""
    mixed = subprocess.run(args + ["--mixed"], capture_output=True, text=True, timeout=60)
    assert mixed.returncode == 0 and "MIXED (--mixed): runs of 2 commits" in mixed.stdout, mixed.stdout


def test_train_ab_prints_report_and_meters_phases(tmp_path):
    conf = tmp_path / "ab.json"
    conf.write_text(json.dumps({"type": "ab", "warmup_steps": 10, "sync_period": 10, "full_rank_steps": 2,
                                "mode": "only-b", "rank_cutoff": 0.6}))
    out = tmp_path / "ab.json.out"
    proc = torchrun(["--hook", "ab", "--config", str(conf), "--steps", "30", "--json-out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AB report: step 30" in proc.stdout and "parameter compression" in proc.stdout and "AB steps:" in proc.stdout
    assert "of plain allreduce's" in proc.stdout  # its share of plain allreduce's bytes, printed (#52)
    summary = json.loads(out.read_text())
    tags = summary["report"]["bytes_by_tag"]
    assert tags["ab-grad"] > 0 and tags["full-grad"] > 0 and tags["sync"] > 0
    assert summary["bytes_per_rank"] == sum(tags.values())
    head = next(layer for layer in summary["report"]["layers"] if layer["name"] == "head.1.weight")
    assert head["rank"] is not None and head["compression"] >= 2.0


def test_bad_config_fails_on_every_rank_without_hang(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "qsr", "h_base": 0}))
    proc = torchrun(["--hook", "qsr", "--config", str(bad), "--steps", "5"], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("config error: qsr.h_base must be >= 1, got 0") == 2, proc.stderr[-2000:]


def test_ab_group_error_on_every_rank_without_hang(tmp_path):
    conf = tmp_path / "ab.json"
    conf.write_text(json.dumps({"type": "ab", "group_size": None, "mode": "groups"}))  # 2 ranks on one node: 1 group
    proc = torchrun(["--hook", "ab", "--config", str(conf), "--steps", "5"], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("config error: ab.group_size 2 (ranks per node, LOCAL_WORLD_SIZE)") == 2, proc.stderr[-2000:]


def test_powersgd_anchor_on_a_model_of_several_buckets(tmp_path):
    """PyTorch's powerSGD_hook on gloo with two or more DDP buckets mismatches the ranks' collectives (its
    callbacks launch allreduces in a different order on each rank); the trainer gives it one bucket.  The
    GPT's 9.8 MB of gradients would fill several."""
    out = tmp_path / "psgd.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    four = [arg if arg != "2" else "4" for arg in TORCHRUN]  # 4 ranks: 2 passed even without the one bucket
    proc = subprocess.run(four + ["-m", "commhooks.tools.train", "--no-progress", "--model", "gpt", "--hook",
                                  "powersgd", "--anchor-start", "2", "--steps", "8", "--json-out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["steps"] == 8 and summary["val_loss"] > 0
