"""Reliability: exact resume in every phase, elastic restart after SIGKILL, consistent configs, divergence,
non-finite values, collective timeouts. Real gloo ranks and real torchrun, each with a timeout."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.comm import CollectiveError
from commhooks.comm.torch_dist import TorchComm
from commhooks.config import ConfigError
from commhooks.algorithms.contract.checks import DivergenceError, NonFiniteError
from tests.dist import run_ranks
from tests.test_ab import batch, mlp, weights

REPO = Path(__file__).resolve().parents[1]
TOTAL = 18
AB = dict(warmup_steps=4, sync_period=6, full_rank_steps=2, rank_cutoff=0.4, min_compression_rate=0.0,
          group_size=1, sync="with-stale")
QSR = dict(alpha=0.05, h_base=2, total_steps=TOTAL)


def build(kind):
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, TOTAL)
    if kind == "ab":
        state = commhooks.ABState(opt, model=net, **AB)
        net.register_comm_hook(state, commhooks.ab_hook)
    else:
        state = commhooks.QSRState(opt, model=net, **QSR)
        net.register_comm_hook(state, commhooks.qsr_hook)
    return net, opt, sched, state


def step_once(net, opt, sched, step, rank):
    x, y = batch(step, rank)
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    opt.step()
    sched.step()


def _resume_everywhere(rank, world, kind, ckdir, stops):
    """Uninterrupted run saving a checkpoint after every stop step; then, for each stop, fresh objects resume."""
    net, opt, sched, state = build(kind)
    phases = {}
    for step in range(TOTAL):
        step_once(net, opt, sched, step, rank)
        if step + 1 in stops:
            phases[step + 1] = state.phase if kind == "ab" else f"since_sync={state.since_sync}"
            commhooks.save_checkpoint(ckdir, net, opt, state, sched, keep=100)
    reference = weights(net.module)
    resumed = {}
    for k in stops:
        net, opt, sched, state = build(kind)
        ck = commhooks.load_checkpoint(ckdir, net, opt, state, sched, step=k)
        assert ck["step"] == k == state.step
        for step in range(k, TOTAL):
            step_once(net, opt, sched, step, rank)
        resumed[k] = weights(net.module)
    return reference, resumed, phases


@pytest.mark.parametrize("kind, stops", [("ab", [3, 5, 7, 9, 12]), ("qsr", [3, 7, 12])])
def test_resume_after_any_step_is_exact(kind, stops, tmp_path):
    for rank, (reference, resumed, phases) in enumerate(run_ranks(_resume_everywhere, 2, timeout=240, kind=kind,
                                                                    ckdir=str(tmp_path), stops=stops)):
        if kind == "ab":  # the stops cover every phase, and the boundaries
            assert {phases[3], phases[5], phases[7], phases[9]} == {"warmup", "ab", "full"}, phases
        else:
            assert any(not v.endswith("=0") for v in phases.values()), phases  # inside a round
        for k, w in resumed.items():
            for n in reference:
                assert torch.equal(reference[n], w[n]), f"rank {rank}: resumed at {k}, {n} differs"


def _checkpoint_layout(rank, world, ckdir):
    net, opt, sched, state = build("qsr")
    for step in range(6):
        step_once(net, opt, sched, step, rank)
        commhooks.save_checkpoint(ckdir, net, opt, state, sched)
    return sorted(p.name for p in Path(ckdir).iterdir()), commhooks.latest_checkpoint(ckdir).name


def test_checkpoint_layout_per_rank_and_latest(tmp_path):
    names, latest = run_ranks(_checkpoint_layout, 2, ckdir=str(tmp_path))[0]
    assert names == ["latest", "step-00000005", "step-00000006"] and latest == "step-00000006"  # keep=2
    assert sorted(p.name for p in (tmp_path / latest).iterdir()) == ["manifest.json", "rank0.pt", "rank1.pt"]


def _commit_with_late_files(rank, world, ckdir, delay):
    """Rank 1's file reaches the folder ``delay`` s after its write returned: as rank 0 sees it on a shared
    filesystem that shows other nodes' files late, or as under NCCL, whose barrier orders the GPU stream and lets
    the host go on.  Then a save whose rank-1 file never shows up (``commit_timeout_s`` 1 s)."""
    import threading

    net, opt, sched, state = build("qsr")
    for step in range(2):
        step_once(net, opt, sched, step, rank)
    real = os.replace
    timers = []

    def land_late(src, dst, *args, **kwargs):
        if str(dst).endswith("rank1.pt"):
            timers.append(threading.Timer(delay, real, (src, dst)) if delay else None)
            if timers[-1] is not None:
                timers[-1].start()
            return None
        return real(src, dst, *args, **kwargs)

    seen = {}
    if rank == 1:
        os.replace = land_late
    try:
        folder = commhooks.save_checkpoint(ckdir, net, opt, state, sched)
        # what rank 0 has committed the moment its save returns
        seen["manifest"] = (folder / "manifest.json").is_file()
        seen["rank1_file"] = (folder / "rank1.pt").is_file()
        seen["latest"] = commhooks.latest_checkpoint(ckdir).name
        step_once(net, opt, sched, 2, rank)
        delay = 0  # from now on rank 1's file never lands
        try:
            commhooks.save_checkpoint(ckdir, net, opt, state, sched, commit_timeout_s=1.0)
            seen["refused"] = None
        except commhooks.CheckpointError as exc:
            seen["refused"] = str(exc)
    finally:
        os.replace = real
        for t in timers:
            if t is not None:
                t.join()
    seen["latest_after_refusal"] = commhooks.latest_checkpoint(ckdir).name
    # a rank whose write fails (a full disk): every rank raises at once, nobody waits for the timeout
    import commhooks.commit as ck

    real_save = ck.digested_save
    if rank == 1:
        ck.digested_save = lambda obj, path: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        started = time.monotonic()
        commhooks.save_checkpoint(ckdir, net, opt, state, sched)
        seen["unwritten"] = None
    except commhooks.CheckpointError as exc:
        seen["unwritten"], seen["unwritten_after_s"] = str(exc), time.monotonic() - started
    finally:
        ck.digested_save = real_save
    net2, opt2, sched2, state2 = build("qsr")
    seen["resumed_step"] = commhooks.load_checkpoint(ckdir, net2, opt2, state2, sched2)["step"]
    return seen


@pytest.mark.serial  # a file 1.5 s late against a 1 s commit timeout
def test_the_commit_waits_for_every_rank_file_and_refuses_one_that_never_lands(tmp_path):
    """The manifest and ``latest`` name a checkpoint only once every rank's file is there: a rank-1 file that
    lands 1.5 s late is waited for (today's commit, a barrier then the manifest, named a folder without it), and
    one that never lands leaves the previous checkpoint the latest, with the same error on every rank."""
    r0, r1 = run_ranks(_commit_with_late_files, 2, timeout=120, ckdir=str(tmp_path), delay=1.5)
    assert r0["manifest"] and r0["rank1_file"] and r0["latest"] == "step-00000002", r0
    for r in (r0, r1):
        assert r["refused"] and "was not committed" in r["refused"] and "commit_timeout_s" in r["refused"], r
        assert r["latest_after_refusal"] == "step-00000002" and r["resumed_step"] == 2, r
    assert "rank1.pt (absent, rank 1 wrote" in r0["refused"], r0["refused"]
    for r in (r0, r1):  # a failed write: refused on every rank, the file's rank named (a hang would have ended
        assert r["unwritten"] and "was not written by rank(s) [1]" in r["unwritten"], r  # in a CollectiveError)
    assert "No space left on device" in r1["unwritten"], r1


# --------------------------------------------------------------------------
# elastic restart under torchrun after a SIGKILL
# --------------------------------------------------------------------------


def worker_pids(marker):
    """PIDs of torchrun's worker processes whose command line contains ``marker``, by RANK."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if marker not in cmd or "torch.distributed.run" in cmd or "-m commhooks.tools.train" not in cmd:
                continue
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode().split("\0") if "=" in kv)
            pids[int(env["RANK"])] = int(proc.name)
        except (OSError, KeyError, ValueError):
            continue
    return pids


def torchrun_train(tmp_path, name, extra, restarts=0):
    out = tmp_path / f"{name}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), "-m", "commhooks.tools.train", "--hook", "qsr", "--config",
           str(REPO / "configs" / "qsr_mnist1d.json"), "--steps", "600", "--no-progress", "--json-out", str(out), *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), out


def test_elastic_restart_after_sigkill_resumes_from_the_last_checkpoint(tmp_path):
    ref_proc, ref_out = torchrun_train(tmp_path, "reference", [])
    ref_stdout, ref_stderr = ref_proc.communicate(timeout=240)
    assert ref_proc.returncode == 0, ref_stderr[-2000:]
    ckdir = tmp_path / "ckpt"
    proc, out = torchrun_train(tmp_path, "killed", ["--checkpoint-dir", str(ckdir), "--checkpoint-every", "50"], restarts=1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait for a checkpoint past step 100, then kill rank 1
        latest = commhooks.latest_checkpoint(ckdir)
        if latest is not None and int(latest.name.split("-")[1]) >= 150:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("no checkpoint at step >= 150 appeared")
    pids = worker_pids(str(ckdir))
    assert 1 in pids, pids
    os.kill(pids[1], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    resumed = [int(line.rsplit(" ", 1)[1]) for line in stdout.splitlines() if "resumed from" in line]
    assert resumed and resumed[0] >= 150 and resumed[0] % 50 == 0, stdout[-2000:]
    ref, got = json.loads(ref_out.read_text()), json.loads(out.read_text())
    assert got["resumed_from"] == resumed[0]
    # resume is exact, so the restarted job ends where the uninterrupted one does
    assert got["params_checksum"] == ref["params_checksum"]
    assert abs(got["test_acc"] - ref["test_acc"]) <= 0.005


# --------------------------------------------------------------------------
# consistency across ranks
# --------------------------------------------------------------------------


def _mismatched(rank, world, what):
    net = DDP(mlp())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    settings = {"h_base": 2 + rank} if what == "config" else {"h_base": 2}
    if what == "version" and rank == 1:
        commhooks.algorithms.contract.state.__version__ = "0.0.0-other"
    if what == "outer":  # another outer optimizer on each rank
        lr = 0.7 if rank == 0 else 0.5
        settings["outer_optimizer"] = lambda ps: torch.optim.SGD(ps, lr=lr)
    try:
        commhooks.QSRState(opt, model=net, **settings)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("what", ["config", "version", "outer"])
def test_mismatched_config_or_version_fails_on_every_rank(what):
    messages = run_ranks(_mismatched, 2, what=what)
    for m in messages:
        assert m is not None and "the QSR hook differs across ranks" in m, messages
    named = {"config": "differs across ranks in config.h_base (", "version": "differs across ranks in version (",
             "outer": "differs across ranks in outer_optimizer ("}[what]
    assert all(named in m for m in messages), messages  # the key that differs, named on every rank
    assert {"config": '"h_base": 3', "version": "0.0.0-other", "outer": "0.5"}[what] in messages[1], messages[1]


class CorruptingComm(TorchComm):
    """Fault injection: real gloo collectives, but rank 1 receives a corrupted sync (a bad NIC, a bit flip)."""

    def allreduce(self, tensors, op="mean", group=None, async_op=False, tag="", metered=True, **kwargs):
        out = super().allreduce(tensors, op=op, group=group, async_op=async_op, tag=tag, metered=metered, **kwargs)
        if tag == "sync" and self.rank == 1:
            tensors[-1].add_(1e-3)
        return out


def _diverging(rank, world):
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = commhooks.QSRState(opt, model=net, h_base=2, check_every=1, comm=CorruptingComm())
    net.register_comm_hook(state, commhooks.qsr_hook)
    try:
        for step in range(4):
            x, y = batch(step, rank)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    except DivergenceError as exc:
        return str(exc), state.step
    return None, state.step


def test_divergence_after_a_sync_is_named_on_every_rank():
    for message, step in run_ranks(_diverging, 2):
        assert message is not None and step == 2, (message, step)
        assert "after QSR sync 1 (step 2): 1 tensor(s) differ across ranks: module.4.bias" in message or \
               "differ across ranks: 4.bias" in message, message


# --------------------------------------------------------------------------
# non-finite values and timeouts
# --------------------------------------------------------------------------


def _nan_before_svd(rank, world):
    """A NaN in rank 1's weights when the first basis is taken (after a step: the ranks start equal, the state
    makes sure of that at set-up)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = commhooks.ABState(opt, model=model, warmup_steps=1, sync_period=5, full_rank_steps=1, mode="only-b")
    if rank == 1:
        with torch.no_grad():
            model[2].weight[0, 0] = float("nan")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    try:
        opt.step()  # the warm-up's one step; the basis after it
    except NonFiniteError as exc:
        return str(exc)
    return None if state.phase != "ab" else "the basis was taken without a word"


@pytest.mark.serial  # a 4 s collective timeout that must not fire
def test_nan_weight_before_the_svd_is_named_on_every_rank():
    for message in run_ranks(_nan_before_svd, 2):
        assert message is not None and "NaN or Inf in 2.weight" in message and "SVD" in message, message


def _nan_loop(rank, net, opt, nan_at, steps=4, before_after=None):
    """``for step in range(steps)``: NaN inputs on this rank at loop step ``nan_at[rank]``; (``before_after``, a
    dict) the weights around that step."""
    for step in range(steps):
        x, y = batch(step, rank)
        if step == nan_at.get(rank):
            x = x * float("nan")
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if step == nan_at.get(rank) and before_after is not None:
            before_after["before"] = weights(net.module)
        opt.step()
        if step == nan_at.get(rank) and before_after is not None:
            before_after["after"] = weights(net.module)


def _raised(run) -> str:
    """``run()``'s NonFiniteError (or CollectiveError: a rank left waiting) as text; None without one."""
    try:
        run()
    except (NonFiniteError, CollectiveError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _nan_gradient(rank, world, policy, folder=None):
    """``"skip"``: a NaN on both ranks at loop step 2 of 4.  ``"raise"``: NaN gradients on both ranks, on rank 0
    at loop step 2 and on rank 1 at step 3 (both before the sync after the 4th optimizer.step()), in a blocking
    QSR sync, a checkpoint after it, an overlapped QSR sync and an AB sync: each one's error."""
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = commhooks.QSRState(opt, model=net, h_base=2, nonfinite=policy, timeout_s=4)
    net.register_comm_hook(state, commhooks.qsr_hook)
    if policy == "skip":
        around = {}
        _nan_loop(rank, net, opt, {0: 2, 1: 2}, before_after=around)
        unchanged = all(torch.equal(around["before"][n], around["after"][n]) for n in around["before"])
        return state.skipped_steps, unchanged, state.step
    out = {"qsr": _raised(lambda: _nan_loop(rank, net, opt, {0: 2, 1: 3}))}
    out["save"] = _raised(lambda: commhooks.save_checkpoint(folder, net, opt, state))  # every rank, collective
    out["state_dict"] = _raised(state.state_dict)  # this rank's own record (no collective)
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = commhooks.QSRState(opt, model=net, h_base=2, outer_lr=0.7, outer_momentum=0.9, overlap_steps=1,
                               timeout_s=4)  # the sync sent after the 4th step lands after the 5th
    net.register_comm_hook(state, commhooks.qsr_hook)
    out["overlap"] = _raised(lambda: _nan_loop(rank, net, opt, {0: 2, 1: 3}, steps=6))
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    state = commhooks.ABState(opt, model=net, **{**AB, "sync_period": 3}, timeout_s=4)  # warm-up 4, sync after 6
    net.register_comm_hook(state, commhooks.ab_hook)
    out["ab"] = _raised(lambda: _nan_loop(rank, net, opt, {0: 4, 1: 5}, steps=7))
    return out


@pytest.mark.serial  # a 4 s collective timeout that must not fire
def test_nan_gradients_on_two_ranks_are_counted_and_named_at_the_loop_s_step_on_every_rank(tmp_path):
    # the guard records on the device (no host read per step) and the record rides in the sync's step proof:
    # at the sync after the NaNs every rank raises together, no rank is left waiting for the other (a timeout
    # would be a CollectiveError); the error counts the ranks that saw one and numbers optimizer steps from 1,
    # so loop step 2 of `for step in range(...)` is optimizer step 3
    r0, r1 = run_ranks(_nan_gradient, 2, timeout=120, policy="raise", folder=str(tmp_path))
    found = {"qsr": "found at the QSR sync after optimizer step 4:",
             "save": "found at the QSR checkpoint after optimizer step 4 (save_checkpoint: the weights may hold it; "
                     "nothing was written):",
             "overlap": "found at the QSR sync sent after optimizer step 4, landed after optimizer step 5:",
             "ab": "found at the AB sync after optimizer step 6:"}
    seen = {"qsr": (3, 4), "save": (3, 4), "overlap": (3, 4), "ab": (5, 6)}  # (rank 0's, rank 1's) loop step + 1
    for run, where in found.items():
        for rank, r in enumerate((r0, r1)):
            said = r[run]
            assert said is not None and said.startswith("NonFiniteError: NaN or Inf gradient on 2 of 2 ranks since "
                                                         f"the last sync, {where}"), (run, rank, said)
            assert f"at optimizer step {seen[run][rank]} on rank {rank} in: 0.weight" in said, (run, rank, said)
            assert "optimizer step N is the Nth optimizer.step() call of the run, counted from 1" in said, said
        assert r0[run].split(": ")[:2] == r1[run].split(": ")[:2], (r0[run], r1[run])  # the same count and place
    for rank, r in enumerate((r0, r1)):  # a state_dict() asks no other rank: it says only what this one saw
        assert r["state_dict"].startswith("NonFiniteError: NaN or Inf gradient on this rank since the last sync, "
                                          "found at the QSR checkpoint after optimizer step 4:"), r["state_dict"]
    assert not list(tmp_path.iterdir()), "nothing may be written"


def test_nan_gradient_skip_policy_counts_and_keeps_ranks_in_step():
    for skipped, unchanged, steps in run_ranks(_nan_gradient, 2, policy="skip"):
        assert (skipped, unchanged, steps) == (1, True, 4)


def _silent_rank(rank, world):
    net = DDP(mlp(), forward_sync_buffers=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    state = commhooks.QSRState(opt, model=net, h_base=2, timeout_s=3)
    net.register_comm_hook(state, commhooks.qsr_hook)
    for step in range(2):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        if step == 1 and rank == 1:
            time.sleep(12)  # stops answering for longer than the timeout
            os._exit(0)
        t0 = time.monotonic()
        try:
            opt.step()
        except CollectiveError as exc:
            return str(exc), time.monotonic() - t0
    return None, None


def _silent_rank_report(rank, world, out):
    result = _silent_rank(rank, world)
    Path(out).write_text(json.dumps(result))
    return result


@pytest.mark.serial  # a 3 s timeout measured against 10 s
def test_timeout_error_names_collective_and_group(tmp_path):
    out = tmp_path / "rank0.json"
    try:
        run_ranks(_silent_rank_report, 2, timeout=60, out=str(out))
    except AssertionError:
        pass  # rank 1 leaves without a result, by design
    message, waited = json.loads(out.read_text())
    assert message is not None, "rank 0 should have failed at the sync"
    assert "commhooks allreduce 'sync'" in message and "group world (ranks [0, 1])" in message, message
    assert "timeout 3 s" in message and waited < 10, (message, waited)
    # the rendezvous store names the peer that did not answer (comm/census.py)
    assert "rank(s) [1] did not answer through the rendezvous store" in message, message
