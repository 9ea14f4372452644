"""`commhooks bench`: the quick configuration, and the network-namespace mode (root)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commhooks.tools.bench import METHODS

REPO = Path(__file__).resolve().parents[1]
FIELDS = {"test_acc", "train_loss", "payload_bytes_per_rank", "meter_bytes_per_rank", "wire_tx_bytes_per_rank",
          "step_ms", "config"}


def bench(args, tmp_path, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "commhooks.cli", "bench", "--out", str(tmp_path), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text()), time.monotonic() - t0, proc.stdout


def test_quick_bench_has_every_field_for_every_method(tmp_path):
    results, elapsed, _ = bench(["--quick"], tmp_path, timeout=300)
    assert elapsed < 60, f"the quick benchmark took {elapsed:.0f} s"
    assert set(results["methods"]) == set(METHODS)
    for name, m in results["methods"].items():
        assert FIELDS <= set(m), (name, set(m))
        assert m["step_ms"]["unlimited"] > 0
    ddp, fp16, qsr = (results["methods"][k]["payload_bytes_per_rank"] for k in ("ddp", "fp16", "qsr"))
    assert fp16 == ddp / 2 and qsr < ddp  # the counter sees torch's hooks and ours alike
    assert results["methods"]["ddp"]["meter_bytes_per_rank"] == ddp  # commhooks' meter agrees with it
    assert results["methods"]["compute-only"]["payload_bytes_per_rank"] == 0
    for f in ("table.md", "accuracy_vs_bytes.png", "time_vs_bandwidth.png"):
        assert (tmp_path / f).stat().st_size > 0
    assert "| ab-x-qsr |" in (tmp_path / "table.md").read_text()


def test_network_namespaces_and_tc(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    results, _, out = bench(["--methods", "ddp,qsr", "--steps", "30", "--bandwidths", "unlimited,100mbit",
                             "--netns", "on"], tmp_path, timeout=600)
    assert results["setup"]["network"].startswith("netns")
    ddp, qsr = results["methods"]["ddp"], results["methods"]["qsr"]
    # the kernel's counters: at least the payload went over each rank's veth, plus headers (< 5 %)
    assert ddp["payload_bytes_per_rank"] <= ddp["wire_tx_bytes_per_rank"] < 1.05 * ddp["payload_bytes_per_rank"] + 2e5
    assert qsr["wire_tx_bytes_per_rank"] < ddp["wire_tx_bytes_per_rank"]
    # tc really throttled the link: a step cannot beat the transmission time of its payload at 100 Mbit/s
    transmit_ms = ddp["payload_bytes_per_rank"] / 30 * 8 / 100e6 * 1000
    assert ddp["step_ms"]["100mbit"] > 0.9 * transmit_ms > 30, (ddp["step_ms"], transmit_ms)
    assert "tbf 100mbit" in results["setup"]["shaping"]["100mbit"]
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "-hub" not in leftover, f"namespaces left behind: {leftover}"
