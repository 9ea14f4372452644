"""`commhooks curves`: the rule and the fixed period swept into curves, compared per seed at equal syncs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commhooks.tools.bench import split_methods
from commhooks.tools.curves import analyse, interpolate, point_configs, t_interval

REPO = Path(__file__).resolve().parents[1]


def run(args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    return subprocess.run([sys.executable, "-m", "commhooks.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_short_sweep_runs_each_point_and_compares_the_rule_at_its_syncs(tmp_path):
    """20 steps, all inside the 50 warm-up steps: the rule at h_base 2 runs as a period of 2 there, so its point
    and the period-2 point are the same training, and their per-seed difference must be exactly 0 (which matches
    within any margin set before the run); at h_base 4 it syncs 5 times, between the periods' 3 and 10, and is
    compared there.  DDP and no communication ran on the same seeds: the table says whether the workload can tell."""
    proc = run(["curves", "--steps", "20", "--seeds", "0,1", "--variant", "fp32=configs/qsr_mnist1d.json",
                "--periods", "2,8", "--alphas", "0.02", "--h-base", "2,4", "--reference", "ddp,compute-only",
                "--margin", "0.005", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    curves = json.loads((tmp_path / "curves.json").read_text())
    points = curves["variants"]["fp32"]["points"]
    assert {n: p["syncs"] for n, p in points.items()} == {"fp32.fixed-h2": 10, "fp32.fixed-h8": 3,
                                                         "fp32.rule-h2-a0.02": 10, "fp32.rule-h4-a0.02": 5}
    assert points["fp32.rule-h2-a0.02"]["by_seed"] == points["fp32.fixed-h2"]["by_seed"]
    compared = curves["variants"]["fp32"]["rule_vs_fixed"]
    assert compared["fp32.rule-h2-a0.02"]["diffs"] == [0.0, 0.0]
    assert compared["fp32.rule-h2-a0.02"]["verdict"] == "matches within ±0.50 points"
    assert len(compared["fp32.rule-h4-a0.02"]["diffs"]) == 2, compared
    assert curves["reference"]["name"] == "ddp" and len(curves["reference"]["by_seed"]) == 2
    gap = curves["no_communication_gap"]
    assert len(gap["by_seed"]) == 2 and "Whether this workload can tell" in (tmp_path / "curves.md").read_text()
    assert "Equivalence margin, set before the run: ±0.50 points" in (tmp_path / "curves.md").read_text()
    fixed8 = json.loads((tmp_path / "configs" / "fp32.fixed-h8.json").read_text())
    assert fixed8["alpha"] == 0.0 and fixed8["h_base"] == 8 and fixed8["average_buffers"] is True
    assert (tmp_path / "curves.png").stat().st_size > 0 and "| fp32.rule-h4-a0.02 | 5 |" in (
        tmp_path / "curves.md").read_text()
    # the bench ran the points as label=config.json methods, and recorded which file each came from
    results = json.loads((tmp_path / "runs" / "results.json").read_text())
    assert results["setup"]["method_configs"]["fp32.fixed-h8"].endswith("configs/fp32.fixed-h8.json")
    replot = run(["curves", "--replot", str(tmp_path)], timeout=120)
    assert replot.returncode == 0 and json.loads((tmp_path / "curves.json").read_text()) == curves


def test_interpolation_is_linear_in_log_syncs_and_never_extrapolates():
    assert interpolate([10, 40], [0.8, 0.9], 20) == pytest.approx(0.85)  # log 20 is halfway between log 10, log 40
    assert interpolate([10, 40], [0.8, 0.9], 40) == 0.9
    assert interpolate([10, 40], [0.8, 0.9], 9) is None and interpolate([10, 40], [0.8, 0.9], 41) is None


def test_t_interval_of_a_mean():
    mean, lo, hi = t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.303 * 1.0 / 3 ** 0.5, rel=1e-4)
    assert t_interval([1.0]) == (1.0, None, None)


def synthetic(metric, rule, fixed_low, fixed_high):
    """Results of a 3-seed run: periods syncing 10 and 40 times, a rule point syncing 20 times."""
    def method(values, syncs):
        return {"quality_by_seed": {str(s): v for s, v in enumerate(values)}, "syncs": syncs,
                "payload_bytes_per_rank": 1.0}
    return {"setup": {"model": "gpt" if metric == "val_loss" else "cnn", "seeds": [0, 1, 2]},
            "methods": {"v.fixed-h4": method(fixed_high, 40), "v.fixed-h16": method(fixed_low, 10),
                        "v.rule-a0.01": method(rule, 20)}}


PLAN = {"v": {"fixed": ["v.fixed-h4", "v.fixed-h16"], "rule": ["v.rule-a0.01"],
              "param": {"v.fixed-h4": {"h_base": 4, "alpha": 0.0}, "v.fixed-h16": {"h_base": 16, "alpha": 0.0},
                        "v.rule-a0.01": {"h_base": 2, "alpha": 0.01}}}}


def test_the_verdict_pairs_seeds_and_knows_which_way_is_better():
    # accuracy: the periods interpolate to 0.85, 0.86, 0.84 at 20 syncs; the rule is 2 points above on each seed
    acc = analyse(synthetic("test_acc", [0.87, 0.88, 0.86], [0.8, 0.81, 0.79], [0.9, 0.91, 0.89]), PLAN, None)
    c = acc["variants"]["v"]["rule_vs_fixed"]["v.rule-a0.01"]
    assert c["verdict"] == "above" and c["mean"] == pytest.approx(0.02)
    # the same numbers as losses: higher is worse, so the rule is below
    loss = analyse(synthetic("val_loss", [0.87, 0.88, 0.86], [0.8, 0.81, 0.79], [0.9, 0.91, 0.89]), PLAN, None)
    assert loss["variants"]["v"]["rule_vs_fixed"]["v.rule-a0.01"]["verdict"] == "below"
    # a difference that changes sign between seeds is not resolved, whatever its mean: never "equal" without a
    # margin set before the run, and with one only where the whole interval lies inside it
    values = [0.87, 0.84, 0.85], [0.8, 0.81, 0.79], [0.9, 0.91, 0.89]
    mixed = analyse(synthetic("test_acc", *values), PLAN, None)["variants"]["v"]["rule_vs_fixed"]["v.rule-a0.01"]
    assert mixed["verdict"] == f"not resolved (could resolve ±{50 * (mixed['hi'] - mixed['lo']):.2f} points)", mixed
    wide = analyse(synthetic("test_acc", *values), PLAN, None, margin=0.01)
    assert wide["variants"]["v"]["rule_vs_fixed"]["v.rule-a0.01"]["verdict"].startswith("not resolved")
    broad = analyse(synthetic("test_acc", *values), PLAN, None, margin=0.1)
    assert broad["variants"]["v"]["rule_vs_fixed"]["v.rule-a0.01"]["verdict"] == "matches within ±10.00 points"


def test_bad_input_is_refused_naming_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="type"):
        point_configs({"type": "ab"}, [2, 4], [0.01], [2])
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        split_methods(["nope"])
    with pytest.raises(ValueError, match="not a JSON config file"):
        split_methods([f"mine={tmp_path / 'missing.json'}"])
    with pytest.raises(ValueError, match="built-in"):
        split_methods(["qsr=configs/qsr_mnist1d.json"])
    assert split_methods(["ddp", "mine=configs/qsr_mnist1d.json"]) == (
        ["ddp", "mine"], {"mine": "configs/qsr_mnist1d.json"})
    proc = run(["curves", "--variant", "x=nothing.json", "--out", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "--variant 'x=nothing.json'" in proc.stderr, proc.stderr[-500:]
    proc = run(["bench", "--quick", "--methods", "qsr,mine=nothing.json"], timeout=60)
    assert proc.returncode == 2 and "error: --methods" in proc.stderr, proc.stderr[-500:]


def test_pooling_puts_the_seeds_paired_differences_together_and_judges_them_again():
    """Two sweeps of the same points on disjoint seeds: one rule point's differences, neither run resolved alone,
    pooled into one interval; a seed in both runs, or a point that synced differently, is refused."""
    from commhooks.tools.curves import pool

    def run(seeds, diffs, syncs=20):
        point = {"syncs": syncs, "diffs": diffs, "verdict": "x"}
        return {"metric": "test_acc", "better": "higher", "seeds": seeds, "setup": {"model": "cnn", "steps": 100},
                "variants": {"v": {"rule_vs_fixed": {"v.rule-a0.01": point},
                                   "points": {"v.rule-a0.01": {"by_seed": [0.9] * len(seeds)}}}}}
    a, b = run(["0", "1", "2"], [0.004, -0.001, 0.006]), run(["3", "4", "5"], [0.003, 0.005, 0.002])
    pooled = pool([a, b])["variants"]["v"]["rule_vs_fixed"]["v.rule-a0.01"]
    assert pooled["diffs"] == [0.004, -0.001, 0.006, 0.003, 0.005, 0.002] and pooled["verdict"] == "above", pooled
    with pytest.raises(ValueError, match="a seed appears in two runs"):
        pool([a, run(["2", "9"], [0.1, 0.1])])
    with pytest.raises(ValueError, match="synced"):
        pool([a, run(["7", "8"], [0.1, 0.1], syncs=21)])
