"""A one-rank NCCL group (``init_process_group("nccl")``, as PyTorch's DDP tutorial does) through every
collective path of the Comm, and QSR / AB states built and stepped on it.  NCCL refuses two ranks on one GPU,
so one rank is what a single lent GPU allows; the multi-rank paths run under ``cuda:gloo``
(test_gpu_ranks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import commhooks
from tests.dist import run_ranks
from tests.gpu.common import TARGET, batch, ddp, local_device, model, record

pytestmark = pytest.mark.skipif(TARGET is None or TARGET.device != "cuda", reason="needs NCCL on a CUDA GPU")


def _nccl(rank, world):
    from commhooks.comm.torch_dist import TorchComm, backend_name

    device = local_device()
    found = {"backend_cuda": backend_name(dist.group.WORLD, device), "backend_cpu": backend_name(dist.group.WORLD,
                                                                                                 torch.device("cpu"))}
    try:  # what an NCCL-only group does with a CPU tensor: the failure the library must never provoke
        dist.all_reduce(torch.ones(1, device="cpu"))
        found["cpu_tensor_refused"] = False
    except Exception as exc:  # noqa: BLE001 - any refusal will do
        found["cpu_tensor_refused"] = type(exc).__name__ + ": " + str(exc).splitlines()[0][:120]
    comm = TorchComm(timeout_s=30)
    found["comm_default_device"] = str(comm.device)
    x = torch.arange(6, dtype=torch.float32, device=device)
    found["native_mean"] = comm._native_mean(x, comm.world)
    # the primitives themselves (the public calls return early for a one-rank group)
    for op in ("mean", "sum", "max"):
        wait, fut = comm._allreduce_flat(x, op, comm.world, async_op=True)
        wait()
    comm._broadcast_flat(x, 0, comm.world)
    gathered = comm._allgather_flat(x.to(torch.uint8), comm.world)()
    found["allgather_ok"] = bool(torch.equal(gathered, x.to(torch.uint8)))
    group = comm.new_group([0], name="one")
    comm._allreduce_flat(x, "sum", group, async_op=False)
    comm.barrier()
    # states built and stepped on the NCCL group, with a checkpoint round trip
    for name, conf in {"qsr-int8-overlap": {"type": "qsr", "h_base": 2, "outer_lr": 0.7, "payload": "int8",
                                            "error_feedback": True, "overlap_steps": 1, "total_steps": 6},
                       "ab-only-b": {"type": "ab", "mode": "only-b", "warmup_steps": 1, "sync_period": 3,
                                     "full_rank_steps": 1, "min_compression_rate": 1.01, "rank_cutoff": 0.8}}.items():
        net = ddp(model(), device)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        state = commhooks.ddp.register(net, opt, conf)
        for step in range(6):
            xb, yb = batch(step, rank, device)
            opt.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            opt.step()
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            commhooks.save_checkpoint(d, net, opt, state)
            commhooks.load_checkpoint(d, net, opt, state)
        found[name] = {"syncs": state.syncs, "step": state.step, "device": str(state.device)}
    return found


def test_one_rank_nccl_every_collective_path():
    found, = run_ranks(_nccl, 1, timeout=300, backend="nccl")
    assert found["backend_cuda"] == "nccl" and found["backend_cpu"] is None, found
    assert found["cpu_tensor_refused"], found  # NCCL alone refuses CPU tensors
    assert found["comm_default_device"].startswith("cuda") and found["native_mean"] is True, found
    assert found["allgather_ok"], found
    for name in ("qsr-int8-overlap", "ab-only-b"):
        assert found[name]["step"] == 6 and found[name]["syncs"] >= 1 and found[name]["device"].startswith("cuda")
    record("one-rank NCCL", found)
