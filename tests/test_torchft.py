"""Live recovery on torchft: two replica groups (one process each, a Lighthouse in the test process); one is
SIGKILLed mid-round, the other goes on syncing alone, the killed group is started again and heals from the live
one; both end bit-identical.  Real torchft (its Rust Lighthouse and Manager), real gloo, no mock."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "torchft_groups.py"  # the docs show it


@pytest.mark.serial  # the Lighthouse's 1 s heartbeat timeout
def test_a_group_killed_mid_round_heals_from_the_live_one_and_they_end_identical(tmp_path):
    from torchft.coordination import LighthouseServer  # the `torchft` extra: a missing install fails here

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "hooks"))
    logs = []

    def start(group, *extra):
        log = open(tmp_path / f"group{group}.{len(logs)}.log", "w")
        logs.append(log.name)
        return subprocess.Popen([sys.executable, str(SCRIPT), str(group), lighthouse.address(), str(tmp_path), *extra],
                                env=env, stdout=log, stderr=subprocess.STDOUT)

    try:
        first, second = start(0), start(1, "--die-at", "30")
        assert second.wait(timeout=180) == -9, Path(logs[1]).read_text()[-3000:]
        time.sleep(1.0)
        again = start(1)  # the restarted group: it joins at the live group's next sync and heals there
        for proc, log in ((first, logs[0]), (again, logs[2])):
            assert proc.wait(timeout=240) == 0, Path(log).read_text()[-4000:]
    finally:
        for proc in (first, second, again) if "again" in dir() else (first, second):
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()
    g0, g1 = (json.loads((tmp_path / f"group{g}.json").read_text()) for g in (0, 1))
    assert g0["step"] == g1["step"] == 240
    # group 0 lost its peer mid-round: its next sync failed and was retried alone, and it synced alone after
    assert g0["retries"] >= 1, g0
    alone = [s for s, groups in g0["sync_quorums"] if groups == 1 and s > 30]  # (group 1 may also start late)
    assert alone, g0["sync_quorums"]
    # the restarted group healed from group 0 at one of its syncs, and from then on every sync had both
    assert g1["heals"] == 1 and g1["joined_at"] > 30 and g1["joined_at"] in [s for s, _ in g0["sync_quorums"]], (g0, g1)
    assert all(groups == 2 for s, groups in g0["sync_quorums"] if s > g1["joined_at"]), g0["sync_quorums"]
    a, b = (torch.load(tmp_path / f"group{g}.pt", weights_only=True) for g in (0, 1))
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.serial  # the Lighthouse's 1 s heartbeat timeout
def test_groups_with_different_configs_are_refused_when_one_heals_from_the_other(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10000, heartbeat_timeout_ms=1000)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "hooks"))
    script = REPO / "tests" / "scripts" / "torchft_mismatch.py"
    try:  # min_replicas 2: both groups in the first quorum, where torchft's init_sync heals one from the other
        procs = [subprocess.Popen([sys.executable, str(script), str(g), lighthouse.address(), str(4 + g)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for g in (0, 1)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()
    refused = [out for p, out in zip(procs, outs) if p.returncode == 3]
    assert len(refused) == 1, outs  # the group that was to be healed, naming what differs and its own value
    assert "ConfigError: commhooks.torchft: this replica group differs from the live group" in refused[0], refused
    assert ("config key h_base: this group 4, the live group 5" in refused[0]
            or "config key h_base: this group 5, the live group 4" in refused[0]), refused[0][-2000:]
