"""Live recovery on torchft: two replica groups of two ranks each (torchrun per group, DDP or FSDP2 inside it, a
Lighthouse in the test process); a rank of one group is SIGKILLed mid-round, torchrun restarts that group, the
other goes on syncing alone, and the restarted group heals from the live one; all ranks end bit-identical.
Groups of one process each: tests/test_faults.py (through the trainer).  Real torchft (its Rust Lighthouse and
Manager), real gloo, no mock."""

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


def _run_groups(tmp_path, inner: str):
    """Two replica groups of 2 ranks (one torchrun each, ``--max-restarts 2``), a Lighthouse in the test process;
    rank 1 of group 1 SIGKILLs itself in step 32 (a sync) of its group's first start, before the step: its rank
    0 syncs with group 0's rank 0, while group 0's rank 1 finds its counterpart gone.  Returns each rank's record."""
    from torchft.coordination import LighthouseServer  # the `torchft` extra: a missing install fails here

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000, heartbeat_timeout_ms=1000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_", "RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "hooks"))
    procs, logs = [], []
    try:
        for group, extra in ((0, []), (1, ["--die-at", "31", "--die-rank", "1"])):  # dies in step 32, a sync
            logs.append(tmp_path / f"group{group}.log")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "--max-restarts", "2", "--monitor-interval", "0.5", str(SCRIPT), str(group), lighthouse.address(),
                 str(tmp_path), "--inner", inner, *extra],
                env=env, stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT))
        for proc, log in zip(procs, logs):
            assert proc.wait(timeout=300) == 0, log.read_text()[-5000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()
    assert "SIGKILL at step 31" in logs[1].read_text()
    return {(g, r): json.loads((tmp_path / f"group{g}.rank{r}.json").read_text()) for g in (0, 1) for r in (0, 1)}


@pytest.mark.serial  # the Lighthouse's 1 s heartbeat timeout
@pytest.mark.parametrize("inner", ["ddp", "fsdp"])
def test_a_rank_killed_takes_its_group_down_and_up_and_it_heals_from_the_live_group(tmp_path, inner):
    """2 groups x 2 ranks, DDP (or FSDP2) inside each: rank 1 of group 1 killed mid-round; torchrun restarts group 1
    as a whole; group 0 goes on alone, both of its ranks alike (torchft's vote is the group's); group 1 heals from
    group 0 rank by rank; all 4 ranks end bit-identical (FSDP2: the gathered model)."""
    rec = _run_groups(tmp_path, inner)
    assert all(r["step"] == 240 for r in rec.values()), rec
    g0, g1 = rec[0, 0], rec[1, 0]
    def quorums(record):  # (step, groups) of each sync (the digests are a rank's own: FSDP2's differ by shard)
        return [q[:2] for q in record["sync_quorums"]]

    assert quorums(rec[0, 1]) == quorums(g0) and rec[0, 1]["retries"] == g0["retries"], rec
    assert quorums(rec[1, 1]) == quorums(g1), rec
    # group 0 lost its peer mid-round: its next sync failed and was retried alone, and it synced alone after
    assert g0["retries"] >= 1 and g0["restarts"] == 0, g0
    alone = [s for s, groups, _ in g0["sync_quorums"] if groups == 1 and s > 30]
    assert alone, g0["sync_quorums"]
    # group 1 was restarted as a whole and healed from group 0 at one of its syncs, each rank with its
    # counterpart's parameters (FSDP2: its shards) as they were after that sync; every later sync had both
    assert all(rec[1, r]["restarts"] == 1 and rec[1, r]["heals"] == 1 for r in (0, 1)), rec
    for r in (0, 1):
        at = {s: d for s, _, d in rec[0, r]["sync_quorums"]}
        assert rec[1, r]["joined_at"] > 30 and at.get(rec[1, r]["joined_at"]) == rec[1, r]["joined_with"], rec
    assert all(groups == 2 for s, groups, _ in g0["sync_quorums"] if s > g1["joined_at"]), g0["sync_quorums"]
    weights = [torch.load(tmp_path / f"group{g}.rank{r}.pt", weights_only=True) for g in (0, 1) for r in (0, 1)]
    for key in weights[0]:
        assert all(torch.equal(weights[0][key], w[key]) for w in weights[1:]), key


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


@pytest.mark.serial  # the Lighthouse's 1 s heartbeat timeout
def test_every_group_killed_after_a_live_checkpoint_resumes_bit_identical_with_a_run_never_killed(tmp_path):
    """A power cut: 2 groups x 2 ranks (DDP inside), each saving its own checkpoints every 50 steps; once both have
    committed step 100, every process is SIGKILLed.  The same command started again resumes every group from the
    newest step all of them committed and ends bit-identical with the run that was never killed."""
    import signal

    from torchft.coordination import LighthouseServer

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_", "RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "hooks"))

    def job(out: Path, until=None):
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=10000, heartbeat_timeout_ms=1000)
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
             "0", str(SCRIPT), str(group), lighthouse.address(), str(out), "--checkpoints", str(out / "ckpt"),
             "--pace", "0.02"], env=env, stdout=open(tmp_path / f"{out.name}.{group}.log", "a"),
            stderr=subprocess.STDOUT, start_new_session=True) for group in (0, 1)]
        try:
            if until is not None:
                deadline = time.monotonic() + 180
                while not until() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
                    time.sleep(0.05)
                assert until() and all(p.poll() is None for p in procs), "the job ended before the cut"
                for proc in procs:
                    os.killpg(proc.pid, signal.SIGKILL)  # every process of every group at once
            for group, proc in enumerate(procs):
                rc = proc.wait(timeout=240)
                assert rc == (-9 if until else 0), (tmp_path / f"{out.name}.{group}.log").read_text()[-4000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            lighthouse.shutdown()

    def committed(out: Path, step: int) -> bool:
        return all((out / "ckpt" / f"group{g}" / f"step-{step:08d}" / "manifest.json").is_file() for g in (0, 1))

    job(tmp_path / "never-killed")
    cut = tmp_path / "cut"
    job(cut, until=lambda: committed(cut, 100))
    assert not list(cut.glob("group*.json"))  # no rank finished
    job(cut)
    resumed = {json.loads((cut / f"group{g}.rank{r}.json").read_text())["resumed_from"] for g in (0, 1) for r in (0, 1)}
    assert len(resumed) == 1 and resumed.pop() >= 100, resumed
    for g in (0, 1):
        for r in (0, 1):
            a, b = (torch.load(d / f"group{g}.rank{r}.pt", weights_only=True) for d in (tmp_path / "never-killed", cut))
            assert all(torch.equal(a[k], b[k]) for k in a), (g, r)


def test_register_names_a_bad_checkpoint_every_and_a_group_size_before_it_joins(tmp_path):
    """Refused before any quorum is asked for (no Manager needed to see it): a save schedule of no steps, and a
    group_size (the groups are torchft's)."""
    import commhooks.torchft

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="checkpoint_every must be a number of steps >= 1 with checkpoint_dir, got 0"):
        commhooks.torchft.register(model, optimizer, {"type": "qsr"}, None, checkpoint_dir=tmp_path)
    with pytest.raises(Exception, match="qsr.group_size 2: under torchft the replica groups are torchft's"):
        commhooks.torchft.register(model, optimizer, {"type": "qsr", "group_size": 2}, None)
