"""torchft's own LocalSGD and DiLoCo as benchmark methods (tools/peers.py): the quick bench runs them beside
compute-only on 2 gloo ranks, each rank one torchft replica under a Lighthouse, with torchft's classes (not
commhooks'); their bytes are counted as every method's (what a rank hands to a collective: here each sync
allreduces the whole model in fp32, fragment by fragment for Streaming DiLoCo), their syncs are torchft's commits,
and the record names the torchft version.  In network namespaces they are refused with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PEERS = ("torchft-localsgd-h4", "torchft-diloco-h4", "torchft-streaming-h4")

pytestmark = pytest.mark.xdist_group("peers")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "bench"
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"), PYTHONPATH=str(REPO / "hooks"))
    proc = subprocess.run([sys.executable, "-m", "commhooks.cli", "bench", "--quick", "--methods",
                           "compute-only," + ",".join(PEERS), "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_torchft_peers_run_by_their_own_code_and_are_metered_alike(quick):
    out, results = quick
    sys.path.insert(0, str(REPO / "hooks"))
    from commhooks.tools.models import build_model

    numel = sum(p.numel() for p in build_model("cnn").parameters())
    for name in PEERS:
        m = results["methods"][name]
        run = json.loads((out / "seed0" / f"{name}.rank0.json").read_text()) if (out / "seed0").is_dir() else \
            json.loads((out / "time-unlimited" / f"{name}.rank0.json").read_text())
        assert run["peer_version"].startswith("torchft "), run
        assert run["method"]["hook"] in ("torchft-localsgd", "torchft-diloco") and run["method"]["peer_sync_every"] == 4
        # 20 steps, a sync every 4: 5 whole-model fp32 allreduces' worth, whoever splits them into fragments
        assert m["payload_bytes_per_rank"] == 5 * 4 * numel, (name, m["payload_bytes_per_rank"], numel)
        assert m["syncs"] >= 5 and 0.0 < m["test_acc"] <= 1.0, (name, m)
    assert results["methods"]["torchft-streaming-h4"]["config_sha256"] != results["methods"]["torchft-diloco-h4"][
        "config_sha256"]  # the peer's arguments are part of the method
    assert "torchft-diloco-h4" in (out / "table.md").read_text()


def test_a_peer_in_network_namespaces_is_refused_with_the_reason():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "hooks"), COMMHOOKS_WIRE_IFACE="veth-x")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           "-m", "commhooks.tools.train", "--hook", "torchft-localsgd", "--peer-sync-every", "4",
                           "--steps", "2", "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "loopback only" in proc.stdout + proc.stderr, proc.stderr[-2000:]


def test_fragments_cover_the_model_once():
    """Streaming DiLoCo's fragments: every parameter in exactly one, a block list split block by block."""
    sys.path.insert(0, str(REPO / "hooks"))
    from commhooks.tools.models import build_model
    from commhooks.tools.peers import fragments_of

    for name in ("gpt", "cnn"):
        model = build_model(name)
        fragments = fragments_of(model, 2)
        held = [id(p) for f in fragments for p in f.parameters()]
        assert len(fragments) == 2 and sorted(held) == sorted(id(p) for p in model.parameters()), name
        assert all(sum(p.numel() for p in f.parameters()) > 0 for f in fragments), name
