"""Faults survived: a rank killed three times (once while writing its checkpoint) under torchrun's restarts ends
bit-identical to the run never killed; the Checkpointer's schedule is the same on every rank; a link down longer
than the timeout is an error on every rank, then a resumed run (the injector, on network namespaces)."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from tests.dist import run_ranks
from tests.test_ab import batch, mlp

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 300, 25


def torchrun(tmp_path, name, extra, restarts=0):
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), "-m", "commhooks.tools.train", "--hook", "qsr", "--config",
           str(REPO / "configs" / "qsr_mnist1d.json"), "--steps", str(STEPS), "--no-progress",
           "--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", str(EVERY), *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)


def kill_plan(seed: int):
    """Three SIGKILLs at seeded random points: two after a step (either rank), one as rank 1 writes a checkpoint."""
    rng = random.Random(seed)
    steps = rng.sample(range(10, STEPS - 10), 2)
    return [{"rank": rng.randrange(2), "step": steps[0], "at": "step"},
            {"rank": rng.randrange(2), "step": steps[1], "at": "step"},
            {"rank": 1, "step": EVERY * rng.randrange(2, STEPS // EVERY - 1), "at": "save"}]


def assert_same(a, b, where):
    """Two state trees equal to the bit: tensors by torch.equal, containers key by key, the rest by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def complete_checkpoints(root: Path):
    """Every folder with a manifest, checked: each rank file it lists is there, at its size, and loads."""
    found = []
    for folder in sorted(root.glob("step-*")):
        if not (folder / "manifest.json").exists():
            continue
        manifest = json.loads((folder / "manifest.json").read_text())
        for r, size in enumerate(manifest["sizes"]):
            path = folder / f"rank{r}.pt"
            assert path.is_file() and path.stat().st_size == size, f"{folder} is committed but {path} is not whole"
            torch.load(path, weights_only=True)
        found.append(folder.name)
    return found


def test_killed_three_times_once_while_saving_ends_bit_identical(tmp_path):
    ref = torchrun(tmp_path, "reference", [])
    assert ref.returncode == 0, ref.stderr[-3000:]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(kill_plan(seed=7)))
    got = torchrun(tmp_path, "killed", ["--fault-plan", str(plan)], restarts=3)
    log = got.stdout + got.stderr
    assert got.returncode == 0, log[-4000:]
    assert sorted(p.name for p in tmp_path.glob("plan.json.fired*")) == [f"plan.json.fired{i}" for i in range(3)], log[-3000:]
    assert log.count("fault plan: SIGKILL") == 3, log[-3000:]
    resumed = [int(line.rsplit(" ", 1)[1]) for line in got.stdout.splitlines() if "resumed from" in line]
    assert len(resumed) == 3 and all(s % EVERY == 0 for s in resumed), got.stdout[-2000:]
    # a kill during a save leaves no committed checkpoint with a missing or partial file: a restart never has to
    # skip one (a manifest written before every rank's file is durable fails here) and every committed one loads
    assert "skipped newer checkpoints" not in log and "not a complete checkpoint" not in log, log[-3000:]
    assert complete_checkpoints(tmp_path / "killed") == complete_checkpoints(tmp_path / "reference") == \
        [f"step-{STEPS - EVERY:08d}", f"step-{STEPS:08d}"]
    for r in range(2):  # the last checkpoint of each run: model, optimizer, hook state, bit for bit
        a = torch.load(tmp_path / "reference" / f"step-{STEPS:08d}" / f"rank{r}.pt", weights_only=True)
        b = torch.load(tmp_path / "killed" / f"step-{STEPS:08d}" / f"rank{r}.pt", weights_only=True)
        for key in a["model"]:
            assert torch.equal(a["model"][key], b["model"][key]), key
        for p, state in a["optimizer"]["state"].items():
            for k, v in state.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"]["state"][p][k])), (p, k)
        assert_same(a["hook"], b["hook"], "hook")  # QSR's step, round, period, syncs and its own tensors


# --------------------------------------------------------------------------
# the Checkpointer's schedule and arguments
# --------------------------------------------------------------------------


def _timed_saves(rank, world, ckdir, out):
    torch.manual_seed(0)
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = commhooks.QSRState(opt, model=net, alpha=0.0, h_base=4)
    net.register_comm_hook(state, commhooks.qsr_hook)
    events = []
    ckpt = commhooks.Checkpointer(ckdir, net, opt, state, every_seconds=0.25, on_event=lambda n, s: events.append((n, s)))
    for step in range(40):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        time.sleep(0.02 if rank == 0 else 0.035)  # rank 1 is slower: the ranks' clocks disagree
        ckpt.after_step()
    ckpt.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"saved": ckpt.saved_steps, "events": events}))


@pytest.mark.serial  # saves every few seconds of wall time
def test_checkpointer_saves_by_time_at_the_same_steps_on_every_rank(tmp_path):
    run_ranks(_timed_saves, 2, timeout=120, ckdir=str(tmp_path / "ck"), out=str(tmp_path))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["saved"] == r1["saved"] and len(r0["saved"]) >= 3, (r0, r1)
    gaps = [b - a for a, b in zip(r0["saved"], r0["saved"][1:])]
    assert all(2 <= g <= 25 for g in gaps), gaps  # 0.25 s at the slower rank's ~36 ms a step: about 7 steps
    assert [n for n, _ in r0["events"][:4]] == ["saving", "writing", "written", "committed"], r0["events"]
    assert commhooks.latest_checkpoint(tmp_path / "ck").name == f"step-{r0['saved'][-1]:08d}"


@pytest.mark.parametrize("kwargs, named", [(dict(every_steps=-1), "every_steps"), (dict(every_seconds="5"), "every_seconds"),
                                           (dict(resume="always"), "resume"), (dict(keep=0), "keep")])
def test_checkpointer_names_a_bad_argument(tmp_path, kwargs, named):
    net = mlp()
    with pytest.raises(ValueError, match=named):
        commhooks.Checkpointer(tmp_path, net, torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)


# --------------------------------------------------------------------------
# a link down for longer than the timeout (the injector, on network namespaces: root, as CI runs)
# --------------------------------------------------------------------------

TIMEOUT_S = 5


@pytest.mark.serial  # each rank must fail within the timeout plus a margin
def test_link_down_is_an_error_naming_the_peers_on_every_rank_then_a_resumed_run(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root; CI runs as root")
    config = json.loads((REPO / "configs" / "qsr_mnist1d.json").read_text())
    config.update(timeout_s=TIMEOUT_S, h_base=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    # 600 steps, the link cut at step 300 (1000 and 500 before): what is shown (each rank fails within the timeout,
    # names the peers, and the restart from the newest checkpoint ends bit-identical) needs only a checkpoint
    # before the cut, and at one every 2 s there are one or more by step 300 (about 5 s in, here)
    cmd = [sys.executable, "-m", "commhooks.cli", "faults", "--ranks", "4", "--nodes", "2", "--reference",
           "--at", "@300:link-down:1:12", "--out", str(out), "--", "--config", str(tmp_path / "config.json"),
           "--steps", "600", "--checkpoint-seconds", "2"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, COMMHOOKS_CACHE=str(REPO / ".cache")),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((out / "faults.json").read_text())
    run = report["faulted"]
    [fault], [failure] = run["faults"], run["failures"]
    assert fault["kind"] == "link-down" and fault["target"] == 1
    # every rank fails on its own (none was stopped by the injector), each within the timeout plus a margin:
    # the next sync (ms away: h_base 2 at this point) and the census (at most 4 s)
    assert failure["exits"] == {str(r): 1 for r in range(4)}, failure
    for r in range(4):
        assert failure["exited_s"][str(r)] - fault["injected_s"] <= TIMEOUT_S + 4 + 3, failure
        error = failure["errors"][str(r)]
        assert "CollectiveError" in error and f"timeout {TIMEOUT_S} s" in error, error
    # the census names the cut-off node's ranks on node 0, and says so on node 1
    for r in (0, 1):
        assert "rank(s) [2, 3] did not answer through the rendezvous store" in failure["errors"][str(r)], failure
    for r in (2, 3):
        assert "could not reach the rendezvous store" in failure["errors"][str(r)], failure
    [restart] = run["restarts"]
    assert restart["resumed_from"] is not None and 0 < restart["resumed_from"] <= failure["step"], run
    assert run["summary"]["steps"] == 600 and run["summary"]["resumed_from"] == restart["resumed_from"]
    assert run["summary"]["params_sha256"] == report["reference"]["summary"]["params_sha256"]
    assert "bit-identical to the fault-free run" in proc.stdout


# --------------------------------------------------------------------------
# live groups over torchft, started by the injector (the trainer's --backend torchft)
# --------------------------------------------------------------------------


@pytest.mark.serial  # torchft's heartbeats and a 30 s collective timeout
def test_injector_live_groups_a_killed_group_heals_and_the_groups_end_identical(tmp_path):
    config = json.loads((REPO / "configs" / "qsr_int8_mnist1d.json").read_text())
    config.update(timeout_s=30, payload_exchange="allgather", error_feedback=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "live"
    # group 0: the group torchft's init_sync copies the others from, and killed before any sync of the run, so
    # the restarted one must still be found behind the live group (its torchft step), not copied to it
    cmd = [sys.executable, "-m", "commhooks.cli", "faults", "--torchft", "--ranks", "2", "--at", "@60:kill:0",
           "--out", str(out), "--", "--model", "gpt", "--steps", "300", "--config", str(tmp_path / "config.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, COMMHOOKS_CACHE=str(REPO / ".cache")),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = json.loads((out / "faults.json").read_text())["faulted"]
    assert [f["kind"] for f in run["faults"]] == ["kill"] and len(run["failures"]) == 1 == len(run["restarts"])
    healed, survivor = run["groups"]
    assert survivor["retries"] >= 1, run  # its next sync lost group 0 and was retried alone
    assert healed["heals"] == 1 and healed["joined_at"] > 60, run  # the restart healed at group 1's step
    assert survivor["heals"] <= 1, run  # (group 1 may heal once at the start, from group 0), never from the restart
    assert run["groups_finished"] == 2 and run["groups_identical"], run["groups"]
    assert "the live groups ended bit-identical" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["--group-ranks", "2", "--", "--checkpoint-every", "5"], "--group-ranks 2 is for --torchft"),
    (["--torchft", "--group-ranks", "0", "--"], "--group-ranks 0: processes per replica group, >= 1")])
def test_group_ranks_is_refused_outside_live_runs_and_below_one(argv, message, capsys):
    from commhooks.tools.faults import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.serial  # 4 processes on loopback, torchft's heartbeats
def test_injector_live_groups_of_two_ranks_restart_a_group_whole_and_heal_it(tmp_path):
    """``--group-ranks 2``: 2 groups of 2 ranks (DDP inside each); a kill of group 0 hits one of its ranks (drawn
    from --seed), the injector stops the other and starts the whole group again, which heals rank by rank from
    group 1 while group 1 goes on; all 4 ranks end bit-identical."""
    config = json.loads((REPO / "configs" / "qsr_int8_mnist1d.json").read_text())
    config.update(timeout_s=30, payload_exchange="allgather", error_feedback=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "live"
    cmd = [sys.executable, "-m", "commhooks.cli", "faults", "--torchft", "--ranks", "2", "--group-ranks", "2",
           "--at", "@20:kill:0", "--out", str(out), "--", "--model", "gpt", "--steps", "120",
           "--config", str(tmp_path / "config.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, COMMHOOKS_CACHE=str(REPO / ".cache")),
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = json.loads((out / "faults.json").read_text())["faulted"]
    [kill], [failure], [restart] = run["faults"], run["failures"], run["restarts"]
    assert failure["failed_ranks"] == [kill["rank"]] and set(failure["exits"]) == {"0", "1"}, failure
    assert restart["logs"] == ["group0.rank0.start1.log", "group0.rank1.start1.log"], restart
    assert sorted(p.name for p in (out / "faulted").glob("summary.rank*.json")) == [
        f"summary.rank{i}.json" for i in range(4)]
    by = {(r["group"], r["rank"]): r for r in run["ranks"]}
    assert by[0, 0]["heals"] == by[0, 1]["heals"] == 1 and by[0, 0]["joined_at"] > 20, run["ranks"]
    assert run["groups_finished"] == 2 and run["groups_identical"], run["ranks"]
    assert "the live groups ended bit-identical" in proc.stdout


def _plain_ddp_saves(rank, world, ckdir):
    torch.manual_seed(0)
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = commhooks.ddp.register(net, opt, {"type": "none"})  # no hook state of its own: the Checkpointer counts
    ckpt = commhooks.Checkpointer(ckdir, net, opt, state, every_steps=5)
    start = ckpt.start_step
    for step in range(start, start + 10):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        ckpt.after_step()
    ckpt.close()
    return start, ckpt.saved_steps


def test_checkpointer_with_plain_ddp_counts_steps_itself_and_resumes(tmp_path):
    first = run_ranks(_plain_ddp_saves, 2, timeout=120, ckdir=str(tmp_path / "ck"))
    again = run_ranks(_plain_ddp_saves, 2, timeout=120, ckdir=str(tmp_path / "ck"))
    assert first == [(0, [5, 10])] * 2 and again == [(10, [15, 20])] * 2, (first, again)
