"""The one-GPU NCCL recipe (tests/gpu/common.nccl_one_gpu_env), checked as far as a CPU machine can: against
the NCCL library of the oldest torch setup.cfg accepts, which is the GPU host's torch (2.11, CUDA 13).  That
torch's CUDA build installs and runs here (.ci/oldest-torch.sh runs this file); its NCCL cannot start without
a GPU, but its library can be read.  What only a GPU shows: that NCCL then really runs 2-4 ranks on one device
(`bash .ci/gpu-check.sh`)."""

from pathlib import Path

import pytest
import torch

from tests.gpu.common import nccl_one_gpu_env

SETUP_CFG = Path(__file__).resolve().parents[2] / "setup.cfg"


def _libnccl() -> Path:
    import nvidia.nccl  # the CUDA build's NCCL wheel (nvidia-nccl-cu13)

    found = sorted(p for d in nvidia.nccl.__path__ for p in Path(d).rglob("libnccl.so*"))
    assert found, f"no libnccl.so under {list(nvidia.nccl.__path__)}"
    return found[0]


def test_this_is_the_oldest_torch_setup_cfg_accepts():
    oldest = next(line.split(">=")[1].split(",")[0] for line in SETUP_CFG.read_text().splitlines()
                  if line.strip().startswith("torch>="))
    assert torch.__version__.split("+")[0].startswith(oldest), (torch.__version__, oldest)


def test_every_recipe_variable_is_one_this_nccl_reads():
    blob = _libnccl().read_bytes()
    env = nccl_one_gpu_env(1)
    for name in env:
        assert name.encode() + b"\0" in blob, f"{name} is not a variable {_libnccl().name} reads"
    # the refusal the recipe gets around, and what it keys on (host hash and bus id)
    assert b"Duplicate GPU detected" in blob
    assert env["NCCL_NET"].encode() + b"\0" in blob  # the transport's name as NCCL spells it
    ranks = [nccl_one_gpu_env(r)["NCCL_HOSTID"] for r in range(4)]
    assert len(set(ranks)) == 4, ranks  # a host of its own for every rank


def test_torch_has_what_the_library_reaches_for():
    import inspect

    import torch.distributed as dist

    assert hasattr(dist, "split_group")
    assert "device_id" in inspect.signature(dist.init_process_group).parameters
    assert "use_local_synchronization" in inspect.signature(dist.new_group).parameters
    assert torch.version.cuda and torch.version.cuda.startswith("13"), torch.version.cuda


@pytest.mark.parametrize("rank", [0, 3])
def test_the_recipe_switches_off_every_same_host_transport(rank):
    env = nccl_one_gpu_env(rank)
    assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == env["NCCL_MNNVL_ENABLE"] == env["NCCL_COLLNET_ENABLE"] == "0"
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
