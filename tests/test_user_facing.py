"""What a user sees: the log_every line, report() for every algorithm, warnings that fire when a run is likely
not what the user meant (and stay silent in the ordinary case), shipped configs by name, DeepSpeed's scheduler
filling the schedule keys."""

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.config import ConfigError, load_config
from tests.dist import run_ranks

pytestmark = pytest.mark.xdist_group("test_user_facing")  # its module fixtures are built once, on one worker

REPO = Path(__file__).resolve().parents[1]


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(config, steps, lr_at=lambda step: 0.05):
    """Train the MLP under DDP (default settings: broadcast_buffers=True) with ``config``; return
    (state, warning messages, log lines)."""
    net = DDP(_net())
    opt = torch.optim.SGD(net.parameters(), lr=lr_at(0))
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("commhooks")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = commhooks.ddp.register(net, opt, config)
        g = torch.Generator().manual_seed(torch.distributed.get_rank())
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad()
            x = torch.randn(16, 16, generator=g)
            F.cross_entropy(net(x), x[:, :4].argmax(1)).backward()
            opt.step()
        if getattr(state, "end_check", None) is not None:
            state.end_check()  # what dropping the state or the process's exit runs: the end-of-run check
    logger.removeHandler(handler)
    return state, [str(w.message) for w in caught if "commhooks" in w.filename or "QSR" in str(w.message)
                   or "AB" in str(w.message)], lines


def _scenarios(rank, world):
    out = {}
    warm = lambda step: 0.05 * min(1.0, (step + 1) / 10)  # noqa: E731  lr warm-up over 10 steps, then flat
    # the ordinary case: buffer-less model under default DDP, warm-up covered, total_steps known
    state, caught, lines = _train({"type": "qsr", "h_base": 3, "alpha": 0.2, "warmup_steps": 10, "total_steps": 30,
                                   "log_every": 10}, 30, warm)
    out["ordinary"] = {"warnings": caught, "lines": lines, "report": state.report()}
    # the lr still rises after warmup_steps
    _, caught, _ = _train({"type": "qsr", "h_base": 3, "alpha": 0.001, "warmup_steps": 4, "total_steps": 20}, 20, warm)
    out["rising"] = caught
    # the rule's period grows with no total_steps: the run may end unsynced
    _, caught, _ = _train({"type": "qsr", "h_base": 2, "alpha": 0.5, "warmup_steps": 2}, 12)
    out["unbounded"] = caught
    # AB whose first basis compresses nothing, and AB that compresses
    ab = {"type": "ab", "warmup_steps": 3, "sync_period": 4, "full_rank_steps": 1, "rank_cutoff": 0.4, "group_size": 1,
          "log_every": 4}
    _, caught, _ = _train({**ab, "min_compression_rate": 1000.0, "total_steps": 8}, 8)
    out["ab_nothing"] = caught
    state, caught, lines = _train({**ab, "min_compression_rate": 0.0, "total_steps": 8}, 8)
    out["ab_ordinary"] = {"warnings": caught, "lines": lines, "report": state.report()}
    # AB with no total_steps (fixed periods too), ending inside an AB phase (step 6 of 4-7)
    _, caught, _ = _train({**ab, "min_compression_rate": 0.0}, 6)
    out["ab_unbounded"] = caught
    # an overlap as long as the shortest period: the sync in flight lands when the next is due
    _, caught, _ = _train({"type": "qsr", "h_base": 2, "alpha": 0.0, "total_steps": 8, "overlap_steps": 2}, 8)
    out["overlap_long"] = caught
    # every rank in one replica group: QSR is DDP with syncs that meet no one (a GPT sweep of periods, 2026-12-07)
    _, caught, _ = _train({"type": "qsr", "h_base": 2, "alpha": 0.0, "group_size": 2, "total_steps": 6}, 6)
    out["one_group"] = caught
    return out


@pytest.fixture(scope="module")
def scenarios():
    return run_ranks(_scenarios, world_size=2, timeout=240)


def test_ordinary_run_is_silent_and_logs_every_n_steps(scenarios):
    for rank, res in enumerate(scenarios):
        assert res["ordinary"]["warnings"] == [], res["ordinary"]["warnings"]  # incl. none about DDP's buffers
        assert res["ab_ordinary"]["warnings"] == [], res["ab_ordinary"]["warnings"]
        lines = res["ordinary"]["lines"]
        if rank == 0:
            assert len(lines) == 3 and lines[0].startswith("QSR step 10 | rule | H "), lines
            assert "syncs" in lines[-1] and "of plain allreduce's" in lines[-1], lines
            assert [line.startswith("AB step ") and "layers compressed" in line
                    for line in res["ab_ordinary"]["lines"]] == [True, True]
        else:
            assert lines == [] and res["ab_ordinary"]["lines"] == []  # rank 0 only


def test_one_replica_group_of_every_rank_is_named_on_every_rank(scenarios):
    for res in scenarios:
        assert any("all 2 ranks form one replica group (group_size 2)" in w and "change nothing" in w
                   for w in res["one_group"]), res["one_group"]
        assert not any("one replica group" in w for w in res["rising"] + res["unbounded"]), res["rising"]


def test_report_is_a_plain_dict_with_bytes_against_allreduce(scenarios):
    r = scenarios[0]["ordinary"]["report"]
    params = sum(p.numel() for p in _net().parameters())
    assert r["algorithm"] == "qsr" and r["step"] == 30 and r["syncs"] >= 3
    assert r["allreduce_bytes"] == 30 * 4 * params
    assert r["bytes_vs_allreduce"] == round(r["bytes"] / r["allreduce_bytes"], 4) < 0.5
    assert r["mean_H"] is not None and r["H_range"][0] <= r["mean_H"] <= r["H_range"][1]
    ab = scenarios[0]["ab_ordinary"]["report"]
    assert ab["algorithm"] == "ab" and ab["allreduce_bytes"] == 8 * 4 * params and ab["layers"]


def test_warning_when_lr_still_rises_after_warmup(scenarios):
    for res in scenarios:
        rising = [w for w in res["rising"] if "still rising" in w]
        assert len(rising) == 1 and "warmup_steps=4" in rising[0], res["rising"]


def test_warning_when_a_period_may_outlast_the_run(scenarios):
    for res in scenarios:
        found = [w for w in res["unbounded"] if "between two syncs" in w]
        assert len(found) == 1 and found[0].startswith("QSR: the run ended at step 12"), res["unbounded"]
        assert "`with state:`" in found[0] and "state.finish()" in found[0], found


def test_warning_when_an_ab_phase_may_outlast_the_run(scenarios):
    for res in scenarios:  # a fixed sync_period too: the run's length need not be a multiple of it
        found = [w for w in res["ab_unbounded"] if "between two syncs" in w]
        assert len(found) == 1 and found[0].startswith("AB: the run ended at step 6"), res["ab_unbounded"]


def test_warning_when_overlap_reaches_the_next_sync(scenarios):
    for res in scenarios:
        found = [w for w in res["overlap_long"] if "overlap_steps=2 >= h_base=2" in w]
        assert len(found) == 1 and "overlap_steps < h_base" in found[0], res["overlap_long"]


def test_warning_when_ab_compresses_nothing(scenarios):
    for res in scenarios:
        found = [w for w in res["ab_nothing"] if "compresses no layer" in w]
        assert len(found) == 1 and "min_compression_rate=1000.0" in found[0], res["ab_nothing"]


def test_log_every_is_validated():
    with pytest.raises(ConfigError, match="log_every"):
        load_config({"type": "qsr", "log_every": -1})


def test_shipped_configs_load_by_name_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("qsr_mnist1d").kind == "qsr" and load_config("ab_mnist1d.json").kind == "ab"
    assert load_config("ds_qsr_bf16_zero2").group_size == 2
    with pytest.raises(ConfigError, match="neither a file nor a shipped config; shipped: .*ab_mnist1d"):
        load_config("qsr_nope")
    listing = subprocess.run([sys.executable, "-m", "commhooks.cli", "configs"], capture_output=True, text=True,
                             check=True).stdout
    for path in (REPO / "configs").glob("*.json"):
        assert path.stem in listing


DS_SCRIPT = r'''
import logging, torch, commhooks.deepspeed as A
from commhooks.launch import init_distributed
init_distributed(timeout=60)
lines = []
h = logging.Handler(); h.emit = lambda r: lines.append(r.getMessage()); logging.getLogger("commhooks").addHandler(h)
base = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**6,
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": 900,
                                                          "warmup_max_lr": 0.01}}}
for hook, expect in (({"type": "qsr", "h_base": 4, "alpha": 0.01}, (100, 900)),
                     ({"type": "qsr", "h_base": 4, "alpha": 0.01, "warmup_steps": 7}, (7, 900)),
                     ({"type": "qsr", "h_base": 4}, (0, 900))):  # a constant period: its warm-up, idle, not filled
    m = torch.nn.Linear(4, 2)
    engine, *_ = A.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.01), config={**base, "comm_hook": hook})
    c = engine.comm_hook_state.config
    assert (c.warmup_steps, c.total_steps) == expect, (c.warmup_steps, c.total_steps)
# a shipped DeepSpeed config by name, as the README shows
m = torch.nn.Linear(4, 2)
engine, *_ = A.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.01), config="ds_qsr_mnist1d")
assert engine.comm_hook_state.config.h_base == 4 and engine.train_micro_batch_size_per_gpu() == 32
print("FILLED", lines)
'''


def test_deepspeed_scheduler_fills_warmup_and_total_steps(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1")
    script = tmp_path / "fill.py"
    script.write_text(DS_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                           str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "qsr.total_steps=900, qsr.warmup_steps=100 taken from DeepSpeed's scheduler WarmupDecayLR" in proc.stdout
    assert "qsr.total_steps=900 taken" in proc.stdout  # the section's own warmup_steps=7 is kept, and not mentioned


def test_scheduler_fill_in_also_replaces_an_explicit_null():
    from commhooks.deepspeed import fill_from_scheduler

    conf = load_config({"type": "qsr", "alpha": 0.004, "warmup_steps": 50, "total_steps": None})  # as shipped
    filled = fill_from_scheduler(conf, {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 700}}})
    assert filled == {"total_steps": 700} and conf.warmup_steps == 50


@pytest.mark.parametrize("section, message", [
    ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, "offload_optimizer.device='cpu'"),
    ({"zero_optimization": {"stage": 1}, "comm_hook": {"type": "ab"}}, "needs zero_optimization.stage 0, got 1"),
    ({"fp16": {"enabled": True}, "comm_hook": {"type": "ab"}}, "does not support DeepSpeed's fp16"),
])
def test_deepspeed_settings_a_hook_cannot_honour_are_refused(section, message):
    from commhooks.deepspeed import check_supported

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_supported({"comm_hook": {"type": "qsr"}, **section})
