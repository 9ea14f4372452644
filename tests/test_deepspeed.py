"""The DeepSpeed adapter in a real DeepSpeed engine (CPU accelerator, gloo), under `deepspeed` and `torchrun`."""

import os
import subprocess
import sys
from pathlib import Path

import json
import math

import pytest
import torch

from commhooks.algorithms.contract import STEP_PROOF_BYTES
from commhooks.launch import free_port

from tests.test_horovod import check_toy

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = str(REPO / "tests" / "scripts" / "ds_equivalence.py")


def ds_env(**extra):
    """The environment of a DeepSpeed run here: no other launcher's variables, one thread, and DeepSpeed's compiled
    ops in the repository's cache (not the user's home: a build killed there would leave a lock every later run
    waits on)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"),
               TORCH_EXTENSIONS_DIR=str(REPO / ".cache" / "torch_extensions"), **extra)
    return env


def launch(launcher, config, out, timeout=300):
    env = ds_env()
    if launcher == "deepspeed":
        deepspeed = BIN / "deepspeed"
        assert deepspeed.exists(), "the deepspeed launcher is missing: the install step (commhooks[deepspeed]) failed"
        cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", str(free_port("127.0.0.1")), SCRIPT]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT]
    cmd += ["--deepspeed_config", str(REPO / "configs" / config), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_same(a, b, what):
    for n in a:
        assert torch.allclose(a[n], b[n], atol=1e-5, rtol=1e-4), f"{what}: {n} differs by {(a[n] - b[n]).abs().max()}"


@pytest.mark.parametrize("launcher, config", [("deepspeed", "ds_ab_mnist1d.json"), ("torchrun", "ds_qsr_mnist1d.json")])
def test_deepspeed_matches_ddp(launcher, config, tmp_path):
    results = launch(launcher, config, tmp_path)
    for r in results:
        for name, run in r["runs"].items():
            (w_ddp, bytes_ddp, steps_ddp), (w_ds, bytes_ds, steps_ds) = run["ddp"], run["ds"]
            assert_same(w_ddp, w_ds, f"{r['kind']} {name}")
            assert bytes_ddp == bytes_ds > 0, (name, bytes_ddp, bytes_ds)  # the meter reads the same payload
            assert steps_ddp == steps_ds == 14
        if r["kind"] == "ab":
            assert set(r["runs"]) == {"base", "only-b", "groups-stale", "ab-x-qsr"}
        (w_ns, b_ns, s_ns), (w_gas, b_gas, s_gas) = r["accumulation"]["ddp_no_sync"], r["accumulation"]["ds_gas2"]
        assert s_ns == s_gas == 14, "gradient accumulation must count optimizer steps"
        assert_same(w_ns, w_gas, "gradient_accumulation_steps=2 vs DDP no_sync")
        assert b_ns == b_gas
        if r["kind"] == "qsr":
            check_toy(r["toy"], "ds", 14)
            # train_batch_size is the global batch over the 2 ranks, as without commhooks (micro, accumulation, dp)
            assert r["batches"]["tbs16"] == (8, 1, 1) and r["batches"]["tbs16-gas2"] == (4, 2, 1), r["batches"]
            assert "train_batch_size 15 cannot be shared by the 2 ranks" in r["batches"]["tbs15"], r["batches"]
        if r["kind"] == "ab":
            assert "needs zero_optimization.stage 0, got 1" in r["zero1"], r["zero1"]
            check_ab_bf16(r)
            if r is results[0]:
                check_flat_master(results)
        else:  # replica groups of one rank: ZeRO-1 shards nothing and trains exactly as stage 0
            assert_same(r["runs"]["base"]["ds"][0], r["zero1"][0], "qsr ZeRO-1 vs stage 0")
            pad = r["zero1"][1] - r["runs"]["base"]["ds"][1]  # ZeRO pads its flat partition to an alignment
            assert pad % 20 == 0 and 0 <= pad <= 20 * 16, pad  # 5 syncs x 4 bytes x the padding elements


def check_flat_master(results):
    """AB under bf16 ZeRO 0 with DeepSpeed's "Adam" and "AdamW" (FusedAdam in FP16_Optimizer: one flat fp32 master)
    compresses the same layers at the same ranks as with a torch AdamW (one fp32 master per parameter), ends with
    the same weights on both ranks, and trains close to it."""
    for r in results:
        runs = r["flat_master"]
        assert runs["Adam"]["wrapper"] == runs["AdamW"]["wrapper"] == "FP16_Optimizer", runs["Adam"]["wrapper"]
        assert runs["client"]["wrapper"] != "FP16_Optimizer", runs["client"]["wrapper"]
        ranks = runs["client"]["ranks"]
        assert ranks and any(k is not None for k in ranks.values()), ranks  # something is compressed
        for name in ("Adam", "AdamW"):
            assert runs[name]["ranks"] == ranks, (name, runs[name]["ranks"], ranks)
            assert runs[name]["syncs"] == runs["client"]["syncs"] >= 2
            gap = distance(runs[name]["params"], runs["client"]["params"])
            size = sum(float(t.double().pow(2).sum()) for t in runs["client"]["params"].values()) ** 0.5
            assert gap < 0.02 * size, (name, gap, size)
    for name in ("Adam", "AdamW", "client"):  # synced at total_steps: the same weights on both ranks
        a, b = results[0]["flat_master"][name]["params"], results[1]["flat_master"][name]["params"]
        assert all(torch.equal(a[n], b[n]) for n in a), name


def distance(a, b):
    return sum(float((a[n] - b[n]).double().pow(2).sum()) for n in a) ** 0.5


def check_ab_bf16(r):
    """AB under DeepSpeed bf16 (ZeRO 0) against DDP with fp32 weights and bf16 autocast.

    The two cannot agree bit for bit: DeepSpeed keeps bf16 weights (fp32 masters) and computes in bf16,
    DDP under autocast keeps fp32 weights.  The tolerance is the precision's own footprint: the distance
    between DDP in fp32 and DDP under autocast (same hook, same data).  DeepSpeed bf16 must be no farther
    from DDP-autocast than 1.5x that; a hook acting on the bf16 copies instead of the fp32 masters (its
    re-basis undone by the next master->bf16 copy) lands far outside.
    """
    (w_ac, bytes_ac, steps_ac), (w_ds, bytes_ds, steps_ds) = r["bf16"]["ddp_autocast"], r["bf16"]["ds_bf16"]
    noise = distance(r["runs"]["base"]["ddp"][0], w_ac)
    moved = distance(w_ac, r["bf16"]["initial"])
    assert 0 < noise < 0.2 * moved, (noise, moved)  # the footprint is small against the training itself
    assert distance(w_ds, w_ac) <= 1.5 * noise, (distance(w_ds, w_ac), noise)
    assert bytes_ac == bytes_ds > 0 and steps_ac == steps_ds == 14


@pytest.fixture(scope="module")
def replica_runs(tmp_path_factory):
    """tests/scripts/ds_replicas.py once (DeepSpeed is slow to start): every rank's record, and the folder."""
    out = tmp_path_factory.mktemp("ds_replicas")
    env = ds_env()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         str(REPO / "tests" / "scripts" / "ds_replicas.py"), "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)], out


@pytest.mark.xdist_group("ds_replicas")  # one 4-rank launch serves both
def test_fp16_loss_scaler_with_replica_groups(replica_runs):
    """fp16 at ZeRO 2 with an overflow in one pair: the loss scaler skips that pair's step, the schedule holds.
    DeepSpeed refuses fp16 on a CPU whose accelerator has no fp16 kernels (this machine's has them since
    2026-12-05): there this is a skip saying so, and the GPU check runs fp16."""
    runs, _ = replica_runs
    fp16 = runs[0]["fp16_zero2_overflow"]
    if isinstance(fp16, str):
        pytest.skip(f"fp16 loss-scaler run not exercised: {fp16}")
    assert [r["fp16_zero2_overflow"]["sync_steps"] for r in runs].count(fp16["sync_steps"]) == 4


@pytest.mark.xdist_group("ds_replicas")  # one 4-rank launch serves both
def test_replica_groups_under_deepspeed_bf16_zero(replica_runs):
    """QSR group_size 2 on 4 ranks in real DeepSpeed engines: bf16 at ZeRO 1, 2 and 3 (the engine's data-parallel
    group is the pair; at stage 3 each rank holds a partition of the parameters themselves), an overflow in one pair only at ZeRO 0 and 2, exact resume at ZeRO 2; an unseeded model
    with groups of one starts from rank 0's weights."""
    runs, tmp_path = replica_runs
    for key in ("bf16_zero1", "bf16_zero2", "bf16_zero3"):
        for r, res in enumerate(runs):
            o = res[key]
            pair = {0, 1} if r < 2 else {2, 3}
            assert o["dp_world"] == 2 and o["sync_steps"] == [3, 6, 9, 12] and o["step"] == 12
            assert o["mp_ranks"] == [r]  # DeepSpeed's model-parallel group: the rank alone
            assert all(math.isfinite(x) for x in o["losses"])
            assert sum(o["losses"][-4:]) < sum(o["losses"][:4]), o["losses"]
            synced = [s in (3, 6, 9, 12) for s in range(1, 13)]
            assert o["all_equal"] == synced, (key, o["all_equal"])  # identical right after a sync, and only then
            assert all(o["pair_equal"]), key  # ZeRO keeps the pair identical every step
            # between syncs nothing leaves the pair but the round's 8-byte period agreement (DeepSpeed may skip
            # a step on overflow, so the lr-dependent period is agreed); at a sync one partition-sized payload
            partition_bytes = 4 * o["partition_numel"] + STEP_PROOF_BYTES
            for step, calls in enumerate(o["calls"], start=1):
                cross = [(ranks, n) for ranks, n in calls if not set(ranks) <= pair]
                if key == "bf16_zero3" and step <= 2:  # DeepSpeed's own check, once, that every rank traced the
                    # same module order (assert_ints_same_as_other_ranks, world-wide lists of ids): small calls only
                    assert all(len(ranks) == 4 and n <= 96 for ranks, n in cross), (step, cross)
                    continue
                agreed = [c for c in cross if c[1] == 8 and len(c[0]) == 4]
                payload = [c for c in cross if c not in agreed]
                assert len(agreed) == (1 if step in (1, 4, 7, 10) else 0), (key, step, cross)
                expected = [(tuple(sorted({r % 2, r % 2 + 2})), partition_bytes)] if step in (3, 6, 9, 12) else []
                assert payload == expected, (key, step, cross)
            assert o["by_tag"] == {"sync": 4 * partition_bytes}
            full = o["final"].numel()
            halves = sum(runs[q][key]["partition_numel"] for q in pair)  # ZeRO pads partitions (not ZeRO-3's views)
            assert o["partition_numel"] < full <= halves, "each rank syncs its half (ZeRO shard)"
    for key in ("bf16_zero0_overflow", "bf16_zero2_overflow"):
        first, second = runs[0][key], runs[2][key]
        assert first["ds_skipped"] == 0 and second["ds_skipped"] == 1, key  # DeepSpeed skipped one pair's step
        assert first["lr"][4] != second["lr"][4], "the skipped pair's lr must lag (else the test proves nothing)"
        for o in (runs[0][key], runs[1][key], runs[2][key], runs[3][key]):
            assert o["step"] == 16 and o["sync_steps"] == first["sync_steps"], (key, o["sync_steps"])
            assert o["all_equal"][-1] and all(o["pair_equal"])
        assert [r[key]["skipped"] for r in runs] == [0, 0, 1, 1]
    seen = [res["data"] for res in runs]  # training_data: a disjoint quarter per rank, not a half per pair
    assert all(len(s) == 16 for s in seen) and sorted(sum(seen, [])) == list(range(64)), seen
    for res in runs:  # exact resume from DeepSpeed's checkpoint plus the hook's state, mid-round (ZeRO 2 and 3)
        assert torch.equal(res["resume"]["straight"], res["resume"]["resumed"])
        assert torch.equal(res["resume_zero3"]["straight"], res["resume_zero3"]["resumed"])
    for res in runs:  # an unseeded model, replica groups of one: the ranks start from rank 0's weights
        for stage in (0, 2):
            u = res["unseeded"][stage]
            assert u["dp_world"] == 1 and not u["before"] and u["after"] and u["masters_equal"], (stage, u)
    for res in runs:  # one rank's NaN: every rank refuses the engine's save, nothing is written, no rank waits
        assert res["nan_save"].startswith("NonFiniteError: NaN or Inf gradient on 1 of 4 ranks since the last sync, "
                                          "found at the QSR checkpoint after optimizer step "), res["nan_save"]
    assert not (tmp_path / "nan").exists()


def _own_groups(rank, world):
    import torch.distributed as dist

    from commhooks.deepspeed.groups import ReplicaGroups, own_group

    from torch.distributed import distributed_c10d

    made = distributed_c10d._world.group_count  # torch counts every group this rank takes part in making by order
    if rank == 0:  # rank 0 alone makes its group while the others wait: nothing of it needs them
        mine = own_group(rank, world)
    dist.barrier()
    if rank != 0:
        mine = own_group(rank, world)
    alone = ReplicaGroups([(0,), (1,), (2,), (3,)])  # group_size 1: the rank's own group in both roles
    made = distributed_c10d._world.group_count - made  # 0: no group made in the world's order (4 each: each rank's)
    one = torch.tensor([float(rank + 1)])
    dist.all_reduce(one, group=mine)  # the rank alone: its own value
    mpu = ReplicaGroups([(0, 1), (2, 3)])  # DeepSpeed's mpu for replica groups of 2
    assert alone.get_data_parallel_group() is alone.get_model_parallel_group()
    return {"own": dist.get_process_group_ranks(mine), "sum": float(one), "made": made,
            "alone": dist.get_process_group_ranks(alone.get_data_parallel_group()),
            "mp": dist.get_process_group_ranks(mpu.get_model_parallel_group()),
            "dp": dist.get_process_group_ranks(mpu.get_data_parallel_group())}


def test_model_parallel_group_is_made_by_its_rank_alone():
    """The mpu's single-rank model-parallel group, and with ``group_size`` 1 its data-parallel group too: each rank
    makes only its own (no rank makes the other ranks' groups at start-up); under gloo (and lazily initialised NCCL) without any collective.  The device-bound path
    (eager NCCL: one split_group entered by every rank) needs several GPUs."""
    from tests.dist import run_ranks

    for r, out in enumerate(run_ranks(_own_groups, 4, timeout=60)):
        assert out == {"own": [r], "sum": float(r + 1), "made": 0, "alone": [r], "mp": [r],
                       "dp": [0, 1] if r < 2 else [2, 3]}, (r, out)


def test_ab_at_zero3_config_error_on_every_rank_without_hang(tmp_path):
    bad = tmp_path / "ds_zero3.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3},'
                   ' "comm_hook": {"type": "ab"}}')
    env = ds_env()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "commhooks.tools.train",
         "--backend", "deepspeed", "--deepspeed_config", str(bad), "--steps", "3", "--no-progress"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("config error: comm_hook type 'ab' needs zero_optimization.stage 0, got 3") == 2, \
        proc.stderr[-2000:]


def test_train_under_deepspeed_launcher(tmp_path):
    env = ds_env()
    proc = subprocess.run(
        [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port("127.0.0.1")), "--module",
         "commhooks.tools.train", "--backend", "deepspeed", "--deepspeed_config", str(REPO / "configs" / "ds_ab_mnist1d.json"),
         "--steps", "230", "--no-progress"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[commhooks] ab: test_acc=" in proc.stdout and "AB report: step 230" in proc.stdout


def test_shipped_bf16_zero2_config_under_the_launcher_script(tmp_path):
    """launchers/deepspeed.sh runs configs/ds_qsr_bf16_zero2.json unchanged: 4 ranks, pairs, bf16, ZeRO 2."""
    env = ds_env(NUM_GPUS="4", DS_CONFIG="configs/ds_qsr_bf16_zero2.json", MASTER_PORT=str(free_port("127.0.0.1")))
    out = tmp_path / "summary.json"
    proc = subprocess.run([str(REPO / "launchers" / "deepspeed.sh"), "--steps", "80", "--no-progress", "--log-every", "40",
                           "--json-out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert summary["ranks"] == 4 and summary["report"]["step"] == 80 and summary["syncs"] >= 5
    by_group, syncs = summary["payload_bytes_by_group"], summary["syncs"]
    # rank 0: ZeRO inside the pair {0,1} every step; its partition with rank 2 at the syncs (the meter's bytes,
    # plus a 32-byte checksum comparison every 10th sync); 8 bytes of period agreement per round over all 4
    assert set(by_group) == {"0-1", "0-2", "0-1-2-3"}
    assert by_group["0-2"] == summary["bytes_per_rank"] + 32 * (syncs // 10)
    assert by_group["0-1-2-3"] == 8 * syncs
    assert "[commhooks] QSR step 40 | " in proc.stderr + proc.stdout
