"""DeepSpeed on the device: fp16 at ZeRO 0 with DeepSpeed's own Adam (FusedAdam inside FP16_Optimizer, one flat
fp32 master per group: the adapter's flat refresh path, which no CPU run reaches; DeepSpeed compiles FusedAdam
at first use, with nvcc, which takes a minute or more of a borrowed host's budget, so only with
COMMHOOKS_GPU_CHECK_FUSED_ADAM=1; otherwise torch's Adam, and the record names the optimizer)
and bf16 at ZeRO 2, each with a QSR comm_hook: after the run's last sync the low-precision weights equal their
fp32 masters; and fp16 at ZeRO 2 on 2 ranks in replica groups of one, the loss scaler skipping a step on one
of them.  CPU mode: bf16 at ZeRO 2 only (DeepSpeed's CPU accelerator); the fp16 cases are reported as skipped
with that reason, here and in the CPU suite."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_ranks
from tests.gpu.common import TARGET, batch, local_device, record

CONFIGS = {
    "fp16-zero0-fused-adam": {"fp16": {"enabled": True, "initial_scale_power": 8}, "zero_optimization": {"stage": 0},
                              "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
    "bf16-zero2": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
}


def _can_compile_ops() -> bool:
    """Whether DeepSpeed can build its fused CUDA ops here (it compiles them at first use, with nvcc)."""
    import shutil

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(shutil.which("nvcc") or (home and os.path.exists(os.path.join(home, "bin", "nvcc"))))


def _engine(rank, world, name):
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:  # a GPU host without DeepSpeed: say so, never skip silently
        raise AssertionError(f"DeepSpeed is not installed for {sys.executable}: carry its wheel "
                             "(make gpu-bundle) or install it there") from exc
    import commhooks.deepspeed
    from tests.gpu.common import model

    device = local_device()
    ds = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
          "comm_hook": {"type": "qsr", "h_base": 2, "total_steps": 6}, **CONFIGS[name]}
    if "optimizer" in ds and not (os.environ.get("COMMHOOKS_GPU_CHECK_FUSED_ADAM") == "1" and _can_compile_ops()):
        # FusedAdam is compiled at first use (nvcc, a minute or more): only when asked for, the budget allowing
        ds["optimizer"] = {**ds["optimizer"], "params": {**ds["optimizer"]["params"], "torch_adam": True}}
    net = model(batchnorm=False)  # DeepSpeed's half-precision engines convert buffers too: keep it plain
    kwargs = {} if "optimizer" in ds else {"optimizer": torch.optim.SGD(net.parameters(), lr=0.05)}
    engine, *_ = commhooks.deepspeed.initialize(model=net, model_parameters=net.parameters(), config=ds, **kwargs)
    state = engine.comm_hook_state
    dtype = next(engine.module.parameters()).dtype
    for step in range(6):
        x, y = batch(step, rank, engine.device)
        loss = F.cross_entropy(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        engine.step()
    lows = torch.cat([p.detach().reshape(-1).float() for p in engine.module.parameters()])
    masters = torch.cat([t.detach().reshape(-1).float() for _, t in state.named_params])
    if masters.numel() == lows.numel():  # ZeRO 0 (flat or per parameter): the refreshed copy equals its master
        refreshed = bool(torch.equal(lows, masters.to(dtype).float()))
    else:  # ZeRO 2 on one rank: the partition is the whole model, padded
        refreshed = bool(torch.equal(lows, masters[: lows.numel()].to(dtype).float()))
    inner = getattr(engine.optimizer, "optimizer", None)
    return {"optimizer": type(engine.optimizer).__name__, "inner": type(inner).__name__ if inner is not None else None,
            "syncs": state.syncs, "step": state.step,
            "refreshed": refreshed, "device": str(device)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deepspeed_on_the_device(name):
    if TARGET.device != "cuda" and name.startswith("fp16"):
        pytest.skip("fp16 with FusedAdam needs CUDA (CPU mode runs bf16 ZeRO 2 only)")
    env = {"TORCH_EXTENSIONS_DIR": os.path.abspath(".cache/torch_extensions")}
    r, = run_ranks(_engine, 1, timeout=240, backend="nccl" if TARGET.device == "cuda" else "gloo", env=env, name=name)
    assert r["step"] == 6 and r["syncs"] == 3, r
    assert r["refreshed"], r
    record(f"DeepSpeed {name}", r)


def _two_rank_env(rank: int) -> dict:
    from tests.gpu.common import rank_env

    return {"TORCH_EXTENSIONS_DIR": os.path.abspath(".cache/torch_extensions"), **rank_env(rank)}


def _fp16_overflow_on_one_replica(rank, world):
    """Two ranks, replica groups of one, fp16 at ZeRO 2: an Inf loss on rank 1 at step 2, which DeepSpeed's loss
    scaler skips on that rank only (its lr scheduler step too)."""
    import commhooks.deepspeed
    from tests.gpu.common import model

    ds = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
          "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}, "zero_optimization": {"stage": 2},
          "comm_hook": {"type": "qsr", "h_base": 2, "group_size": 1, "total_steps": 8}}
    net = model(batchnorm=False)
    engine, *_ = commhooks.deepspeed.initialize(model=net, model_parameters=net.parameters(), config=ds,
                                                optimizer=torch.optim.SGD(net.parameters(), lr=0.05))
    state = engine.comm_hook_state
    for step in range(8):
        x, y = batch(step, rank, engine.device)
        loss = F.cross_entropy(engine(x.half()).float(), y)
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
    weights = torch.cat([p.detach().reshape(-1).float().to("cpu") for p in engine.module.parameters()])
    return {"sync_steps": list(state.sync_steps), "step": state.step, "ds_skipped": engine.skipped_steps,
            "weights": weights}


def test_deepspeed_fp16_loss_scaler_with_replica_groups():
    """The fp16 loss scaler skipping a step on one replica only: every rank keeps the schedule, the run ends with
    identical ranks, over NCCL.  CPU mode: skipped, saying why (the CPU suite runs fp16 replica groups on gloo
    where DeepSpeed's CPU accelerator has fp16: tests/test_deepspeed.py)."""
    if TARGET.device != "cuda":
        pytest.skip("fp16 replica groups over NCCL needs CUDA (the CPU suite runs them on gloo)")
    r0, r1 = run_ranks(_fp16_overflow_on_one_replica, 2, timeout=240, backend=TARGET.backend, env=_two_rank_env,
                       device_id=TARGET.device_id)
    assert (r0["ds_skipped"], r1["ds_skipped"]) == (0, 1), (r0["ds_skipped"], r1["ds_skipped"])
    assert r0["step"] == r1["step"] == 8 and r0["sync_steps"] == r1["sync_steps"], (r0, r1)
    assert torch.equal(r0["weights"], r1["weights"])
    record("DeepSpeed fp16-zero2 replicas, overflow on rank 1",
           {"sync_steps": r0["sync_steps"], "skipped": [r0["ds_skipped"], r1["ds_skipped"]]})
