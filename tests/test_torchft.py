"""Live recovery on torchft: replica groups of two ranks each (torchrun per group, DDP or FSDP2 inside it, a
Lighthouse in the test process), started from different seeds; a rank of one group is SIGKILLed mid-round, torchrun
restarts that group, the others go on syncing, and the restarted group heals from one live group; all ranks end
bit-identical.  Groups of one process each: tests/test_faults.py (through the trainer).  Real torchft (its Rust
Lighthouse and Manager), real gloo, no mock."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "torchft_groups.py"  # the docs show it


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_", "RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "hooks"))
    return env


def _lighthouse(min_replicas: int):
    from torchft.coordination import LighthouseServer  # the `torchft` extra: a missing install fails here

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=2000, heartbeat_timeout_ms=1000)


def _group(group: int, lighthouse, out: Path, log: Path, *extra: str, restarts: int = 2):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
         str(restarts), "--monitor-interval", "0.5", str(SCRIPT), str(group), lighthouse.address(), str(out), *extra],
        env=_env(), stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)


def _records(out: Path, groups: int):
    return {(g, r): json.loads((out / f"group{g}.rank{r}.json").read_text()) for g in range(groups) for r in (0, 1)}


def _assert_one_model(out: Path, groups: int):
    """Every rank of every group holds the same parameters (FSDP2: as gathered inside its group)."""
    weights = {(g, r): torch.load(out / f"group{g}.rank{r}.pt", weights_only=True) for g in range(groups)
               for r in (0, 1)}
    first = weights[0, 0]
    differ = [where for where, w in weights.items() if any(not torch.equal(first[k], w[k]) for k in first)]
    assert not differ, f"ranks that differ from group 0's rank 0: {differ}"


@pytest.mark.serial  # the Lighthouse's 1 s heartbeat timeout
@pytest.mark.parametrize("inner", ["ddp", "fsdp"])
def test_three_groups_seeded_apart_one_killed_every_group_heals_whole_from_one_group(tmp_path, inner):
    """3 groups x 2 ranks, DDP (or FSDP2) inside each, each group seeded apart, the docs' Lighthouse
    (``--min_replicas 1``) and ``--groups 3`` (a first start waits for all three).  torchft 0.2.0 picks a heal's
    source per rank, so without commhooks' plan rank 0 of a group heals from one group and rank 1 from another (at
    the fresh start as well: group 0's rank 1 from group 1): under DDP its ranks then train different models.
    Rank 1 of group 2 is killed inside step 32 (a sync); torchrun restarts group 2 whole; groups 0 and 1 go on; group
    2 heals, both its ranks from the same live group; all 6 ranks end bit-identical."""
    out = tmp_path / "out"
    lighthouse = _lighthouse(1)
    procs = []
    try:
        for g in range(3):
            kill = ["--die-at", "31", "--die-rank", "1"] if g == 2 else []
            procs.append(_group(g, lighthouse, out, tmp_path / f"group{g}.log", "--inner", inner, "--groups", "3",
                                *kill))
        for g, proc in enumerate(procs):
            assert proc.wait(timeout=300) == 0, (tmp_path / f"group{g}.log").read_text()[-5000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        lighthouse.shutdown()
    assert "SIGKILL at step 31" in (tmp_path / "group2.log").read_text()
    rec = _records(out, 3)
    assert all(r["step"] == 240 for r in rec.values()), rec
    # the fresh start: group 1 healed from group 0 (torchft's primary for group rank 0), both ranks alike (once
    # or more: until all three have joined, each quorum of the fresh start heals the others from its primary)
    assert rec[0, 0]["heals"] == rec[0, 1]["heals"] == 0 and rec[1, 0]["healed_from"] == "group0", rec
    assert rec[1, 1]["healed_from"] == "group0" and rec[1, 0]["heals"] == rec[1, 1]["heals"] >= 1, rec
    # group 2 was restarted whole and healed once, both ranks from the same live group, mid-run
    assert all(rec[2, r]["restarts"] == 1 and rec[2, r]["heals"] == 1 for r in (0, 1)), rec
    assert rec[2, 0]["healed_from"] == rec[2, 1]["healed_from"] in ("group0", "group1"), rec
    assert rec[2, 0]["joined_at"] == rec[2, 1]["joined_at"] > 30, rec
    if inner == "ddp":  # each rank the whole model: the same digest (FSDP2's ranks hold different shards)
        assert rec[2, 0]["joined_with"] == rec[2, 1]["joined_with"], rec
    # the survivors lost group 2 mid-round: a sync retried, both ranks of a group alike, then syncs of 2 groups
    for g in (0, 1):
        assert rec[g, 0]["retries"] >= 1 and rec[g, 0]["retries"] == rec[g, 1]["retries"], rec
        assert [q[:2] for q in rec[g, 0]["sync_quorums"]] == [q[:2] for q in rec[g, 1]["sync_quorums"]], rec
        assert any(groups == 2 for s, groups, _ in rec[g, 0]["sync_quorums"] if s > 30), rec[g, 0]["sync_quorums"]
    assert all(groups == 3 for s, groups, _ in rec[0, 0]["sync_quorums"] if s > rec[2, 0]["joined_at"]), rec
    _assert_one_model(out, 3)


@pytest.mark.serial  # the Lighthouse's 1 s heartbeat timeout
def test_a_power_cut_resumes_every_group_from_its_checkpoint_with_the_docs_lighthouse(tmp_path):
    """A power cut: 2 groups x 2 ranks (DDP inside, seeded apart), each saving its own checkpoints every 50 steps,
    under the docs' Lighthouse (``--min_replicas 1``); once both have committed step 100, every process is
    SIGKILLed.  The same command started again, group 1 two seconds after group 0 (which, under min_replicas 1,
    forms a quorum alone), resumes every group from the newest step all of them committed (group 0 waits for the
    two groups its checkpoint was saved with) and ends bit-identical with the run never killed."""
    def job(out: Path, until=None, stagger_s: float = 0.0, groups=("--groups", "2")):
        lighthouse = _lighthouse(1)
        procs = []
        try:
            for g in (0, 1):
                procs.append(_group(g, lighthouse, out, tmp_path / f"{out.name}.{g}.log", "--checkpoints",
                                    str(out / "ckpt"), "--pace", "0.02", *groups, restarts=0))
                time.sleep(stagger_s)
            if until is not None:
                deadline = time.monotonic() + 180
                while not until() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
                    time.sleep(0.05)
                assert until() and all(p.poll() is None for p in procs), "the job ended before the cut"
                for proc in procs:
                    os.killpg(proc.pid, signal.SIGKILL)  # every process of every group at once
            for g, proc in enumerate(procs):
                rc = proc.wait(timeout=240)
                assert rc == (-9 if until else 0), (tmp_path / f"{out.name}.{g}.log").read_text()[-4000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            lighthouse.shutdown()

    def committed(out: Path, step: int) -> bool:
        return all((out / "ckpt" / f"group{g}" / f"step-{step:08d}" / "manifest.json").is_file() for g in (0, 1))

    job(tmp_path / "never-killed")
    _assert_one_model(tmp_path / "never-killed", 2)  # seeded apart: one group's start, both ranks of each alike
    cut = tmp_path / "cut"
    job(cut, until=lambda: committed(cut, 100))
    assert not list(cut.glob("group*.json"))  # no rank finished
    job(cut, stagger_s=2.0, groups=())  # no --groups: the checkpoints say how many groups to wait for
    resumed = {json.loads((cut / f"group{g}.rank{r}.json").read_text())["resumed_from"] for g in (0, 1) for r in (0, 1)}
    assert len(resumed) == 1 and resumed.pop() >= 100, resumed
    for g in (0, 1):
        for r in (0, 1):
            a, b = (torch.load(d / f"group{g}.rank{r}.pt", weights_only=True) for d in (tmp_path / "never-killed", cut))
            assert all(torch.equal(a[k], b[k]) for k in a), (g, r)


@pytest.mark.serial  # the Lighthouse's 1 s heartbeat timeout
def test_a_config_that_differs_is_named_on_every_rank_of_both_groups(tmp_path):
    """Group 0 trains (the docs' Lighthouse); group 1 joins with h_base 5 against 4: group 1 stops on both ranks
    with a ConfigError naming h_base and both groups' values; group 0 is told the same on both ranks, warns, and
    finishes its run alone."""
    out = tmp_path / "out"
    lighthouse = _lighthouse(1)
    procs = []
    try:
        procs.append(_group(0, lighthouse, out, tmp_path / "group0.log", "--pace", "0.03", restarts=0))
        time.sleep(4.0)  # group 0 is training alone by now
        procs.append(_group(1, lighthouse, out, tmp_path / "group1.log", "--h-base", "5", restarts=0))
        rcs = [p.wait(timeout=240) for p in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        lighthouse.shutdown()
    logs = [(tmp_path / f"group{g}.log").read_text() for g in (0, 1)]
    assert rcs[0] == 0 and rcs[1] != 0, (rcs, logs[1][-3000:])
    named = "config.h_base: group0 4, group1 5"
    for rank in (0, 1):
        assert any(f"[rank{rank}]" in line and "ConfigError" in line and named in line
                   for line in logs[1].splitlines()), logs[1][-3000:]
    assert logs[0].count(named) >= 2 and "the group that joined is refused" in logs[0], logs[0][-3000:]
    assert all(json.loads((out / f"group0.rank{r}.json").read_text())["step"] == 240 for r in (0, 1))


def test_register_names_what_live_groups_cannot_run_before_it_joins(tmp_path):
    """Refused before any quorum is asked for (no Manager needed to see it): a save schedule of no steps, a
    group_size (the groups are torchft's), AB (its groups average gradients every step, in both modes: not "needs
    2 ranks"), the two-step exchange by name, and a wait for no groups."""
    import commhooks.torchft

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="checkpoint_every must be a number of steps >= 1 with checkpoint_dir, got 0"):
        commhooks.torchft.register(model, optimizer, {"type": "qsr"}, None, checkpoint_dir=tmp_path)
    with pytest.raises(Exception, match="qsr.group_size 2: under torchft the replica groups are torchft's"):
        commhooks.torchft.register(model, optimizer, {"type": "qsr", "group_size": 2}, None)
    for mode in ("groups", "only-b"):
        with pytest.raises(commhooks.ConfigError, match=f"ab averages gradients at every step in every mode "
                                                        f"\\(ab.mode '{mode}'"):
            commhooks.torchft.register(model, optimizer, {"type": "ab", "mode": mode}, None)
    with pytest.raises(commhooks.ConfigError, match="qsr.payload_exchange 'two_step' \\(payload 'int2'\\)"):
        commhooks.torchft.register(model, optimizer, {"type": "qsr", "payload": "int2",
                                                      "payload_exchange": "two_step"}, None)
    with pytest.raises(ValueError, match="wait_for_groups must be a number of replica groups >= 1, got 0"):
        commhooks.torchft.register(model, optimizer, {"type": "qsr"}, None, wait_for_groups=0)
