"""`commhooks bench`: the quick configuration, and the network-namespace mode (root)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commhooks.tools.bench import METHODS

REPO = Path(__file__).resolve().parents[1]
FIELDS = {"test_acc", "train_loss", "payload_bytes_per_rank", "meter_bytes_per_rank", "wire_tx_bytes_per_rank",
          "step_ms", "config"}


def bench(args, tmp_path, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "commhooks.cli", "bench", "--out", str(tmp_path), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text()), time.monotonic() - t0, proc.stdout


def test_quick_bench_has_every_field_for_every_method(tmp_path):
    results, _, _ = bench(["--quick"], tmp_path, timeout=300)  # (its speed is the benchmark's business, not a test's)
    assert set(results["methods"]) == set(METHODS)
    for name, m in results["methods"].items():
        assert FIELDS <= set(m), (name, set(m))
        assert m["step_ms"]["unlimited"] > 0
    ddp, fp16, qsr = (results["methods"][k]["payload_bytes_per_rank"] for k in ("ddp", "fp16", "qsr"))
    assert fp16 == ddp / 2 and qsr < ddp  # the counter sees torch's hooks and ours alike
    assert results["methods"]["ddp"]["meter_bytes_per_rank"] == ddp  # commhooks' meter agrees with it
    assert results["methods"]["compute-only"]["payload_bytes_per_rank"] == 0
    for f in ("table.md", "accuracy_vs_bytes.png", "time_vs_bandwidth.png"):
        assert (tmp_path / f).stat().st_size > 0
    assert "| ab-x-qsr |" in (tmp_path / "table.md").read_text()
    # the protocol's record (docs/pages/tools/measure.md): the commit, the pinning, the load; per method its config's hash,
    # how a repeat's pace was taken, and the paired ratios (one repeat here: said so in the table)
    setup = results["setup"]
    assert len(setup["commit"]) == 40 and isinstance(setup["dirty"], bool), setup
    assert setup["pinned"] is True and set(setup["load"]) == {"unlimited"}, setup  # 2 ranks on 2 cores
    assert results["methods"]["compute-only"]["pace"].startswith("mean of ranks")
    assert results["methods"]["ddp"]["pace"] == "slowest rank"
    for name, m in results["methods"].items():
        assert len(m["config_sha256"]) == 16 and len(m["step_ms_repeats_by_rank"]["unlimited"]) == 2, name
        paired = m["ratios"]["unlimited"]
        if name != "compute-only":
            assert paired["vs compute-only"]["repeats"] == 1, name
        assert (paired["ddp over this"] is None) == (name == "ddp"), name  # a baseline is not divided by itself
    assert "(1 repeat)" in (tmp_path / "table.md").read_text()


def test_repeats_give_paired_ratios_with_an_interval(tmp_path):
    """Three interleaved repeats, each qsr run between two compute-only runs (F Q F Q F Q F): each method's pace
    per run, qsr's ratio to the geometric mean of the compute-only runs around it, and the median's interval in
    the table (resolved or not: 20 steps resolve nothing reliably)."""
    results, _, _ = bench(["--quick", "--repeats", "3", "--methods", "compute-only,qsr,ddp"], tmp_path, timeout=300)
    floor, qsr, ddp = (results["methods"][k] for k in ("compute-only", "qsr", "ddp"))
    assert results["setup"]["pairing"] == "bracketed"
    for m, runs in ((floor, 7), (qsr, 3), (ddp, 3)):
        by_rank = m["step_ms_repeats_by_rank"]["unlimited"]
        assert len(by_rank) == 2 and all(len(times) == runs for times in by_rank), by_rank
    paces = floor["step_ms_paces"]["unlimited"]
    assert paces == [sum(r[k] for r in floor["step_ms_repeats_by_rank"]["unlimited"]) / 2 for k in range(7)]
    assert qsr["step_ms_paces"]["unlimited"] == [max(r[k] for r in qsr["step_ms_repeats_by_rank"]["unlimited"])
                                                 for k in range(3)]
    ratio = qsr["ratios"]["unlimited"]["vs compute-only"]
    assert ratio["ratios"] == pytest.approx([q / (paces[2 * k] * paces[2 * k + 1]) ** 0.5
                                             for k, q in enumerate(qsr["step_ms_paces"]["unlimited"])])
    spec = list(json.loads((tmp_path / "time-unlimited" / "spec.json").read_text()))
    assert spec == ["compute-only", "qsr", "compute-only#1", "ddp", "compute-only#2", "qsr#1", "compute-only#3",
                    "ddp#1", "compute-only#4", "qsr#2", "compute-only#5", "ddp#2", "compute-only#6"], spec
    # compute-only ran 7 times, DDP 3: DDP over compute-only divides each DDP run by the runs around it
    paces = floor["step_ms_paces"]["unlimited"]
    assert floor["ratios"]["unlimited"]["ddp over this"]["ratios"] == pytest.approx(
        [d / (paces[2 * k + 1] * paces[2 * k + 2]) ** 0.5 for k, d in enumerate(ddp["step_ms_paces"]["unlimited"])])
    assert ratio["lo"] <= ratio["median"] <= ratio["hi"] and ratio["repeats"] == 3
    row = next(line for line in (tmp_path / "table.md").read_text().splitlines() if line.startswith("| qsr |"))
    # 3 repeats: the range of the ratios and the count, no interval and no verdict (9 give one)
    assert not ratio["resolved"] and (ratio["lo"], ratio["hi"]) == (min(ratio["ratios"]), max(ratio["ratios"]))
    assert f"| {ratio['median']:.2f}x (range {ratio['lo']:.2f}-{ratio['hi']:.2f} of 3 repeats) |" in row, row
    assert "resolved" not in row, row
    # the time's window and the same steps' bytes: every step but the first, of the 20 the quick run times
    assert qsr["timed_window"] == [2, 20] and 0 < qsr["window_payload_bytes_per_rank"] <= qsr["payload_bytes_per_rank"]
    assert floor["window_payload_bytes_per_rank"] == 0 and qsr["window_syncs"] <= qsr["syncs"]


def test_ranks_that_share_the_cores_are_paced_by_the_slowest_and_a_recorded_run_is_read_again():
    """Ranks that never wait are averaged only where each has a core: the GPT headline's compute-only runs (4
    ranks, 2 cores) had ranks at 103-230 ms in one run (one finished early and gave its core to the others),
    where the slowest rank, the whole work over the cores, ran at 210-230 ms in every run.  ``repace`` reads a
    recorded run's per-rank times again by this rule and its ratios with them, and says so under the table."""
    from commhooks.tools import timing
    from commhooks.tools.bench import add_ratios, provenance_line, repace

    assert timing.independent(True, 2, 2) and not timing.independent(True, 4, 2) and not timing.independent(False, 2, 2)
    floor_times = [[214.6, 227.7, 103.2, 141.5], [213.9, 230.3, 162.5, 200.8], [210.5, 230.2, 202.6, 202.0],
                   [210.5, 230.0, 162.1, 102.0]]  # rank r's step time in compute-only's run k (recorded)
    mean_paces = [sum(r[k] for r in floor_times) / 4 for k in range(4)]
    ddp_times = [[1418.0, 1408.0]] * 4
    results = {"setup": {"ranks": 4, "cores": 2, "repeats": 1, "pairing": "rounds", "commit": "a" * 40,
                         "dirty": False, "date": "2026-12-07"},
               "methods": {"ddp": {"payload_bytes_per_rank": 1.0, "step_ms_repeats_by_rank": {"x": ddp_times},
                                   "step_ms_paces": {"x": [1418.0, 1408.0]}, "step_ms": {"x": 1413.0}},
                           "compute-only": {"payload_bytes_per_rank": 0, "step_ms_paces": {"x": mean_paces[:2]},
                                            "step_ms_repeats_by_rank": {"x": [r[:2] for r in floor_times]},
                                            "step_ms": {"x": sum(mean_paces[:2]) / 2}}}}
    add_ratios(results)
    before = results["methods"]["compute-only"]["ratios"]["x"]["ddp over this"]["median"]
    assert repace(results) is True
    floor = results["methods"]["compute-only"]
    assert floor["step_ms_paces"]["x"] == [214.6, 230.3] and floor["pace"] == "slowest rank (the ranks share the cores)"
    after = floor["ratios"]["x"]["ddp over this"]["median"]
    assert after == pytest.approx((1418.0 / 214.6 + 1408.0 / 230.3) / 2) and after < before
    assert results["setup"]["repaced"]["commit"] and repace(results) is False  # read by today's rule: no change
    assert "Paces taken again from the run's per-rank times" in provenance_line(results)
    results["setup"]["cores"] = 4  # a core each: the mean, as recorded before
    assert repace(results) is True and floor["step_ms_paces"]["x"] == pytest.approx(mean_paces[:2])


def test_a_ratio_is_resolved_only_when_its_interval_clears_one_and_the_target():
    """The 2026-12-06 record: the shipped MNIST-1D winner's per-repeat ratios ran from 0.85x to 1.39x, and its
    table said 1.03x.  Under the protocol that is 'not resolved'; tight repeats above 1 resolve, unless the
    interval holds the target too; fewer than 9 repeats resolve nothing (their range, not an interval)."""
    from commhooks.tools import timing

    spread = timing.paired_ratio([0.85, 1.03, 1.39, 0.95, 1.20, 0.9, 1.1, 1.05, 1.0], [1.0] * 9)
    assert not spread["resolved"] and spread["median"] == 1.03
    assert timing.describe(spread).startswith("1.03x [") and timing.describe(spread).endswith("] not resolved")
    tight = timing.paired_ratio([1.045, 1.023, 1.047, 1.04, 1.05, 1.043, 1.038, 1.046, 1.041], [1.0] * 9)
    assert tight["resolved"] and 1.0 < tight["lo"] <= tight["median"] <= tight["hi"] <= 1.05
    assert not timing.paired_ratio([1.045, 1.023, 1.047, 1.04, 1.05, 1.043, 1.038, 1.046, 1.041], [1.0] * 9,
                                   targets=(1.0, 1.04))["resolved"]
    five = timing.paired_ratio([1.06, 1.023, 1.047, 1.04, 1.05], [1.0] * 5)
    assert not five["resolved"] and timing.describe(five) == "1.05x (range 1.02-1.06 of 5 repeats)"
    assert timing.pace([4.62, 7.10], independent=True) == pytest.approx(5.86)  # ranks that never wait: the mean
    assert timing.pace([4.62, 7.10], independent=False) == 7.10  # ranks that sync: the slowest
    with pytest.raises(ValueError, match="paired repeats differ"):
        timing.paired_ratio([1.0, 2.0], [1.0])
    # each method between two compute-only runs; a drift of the machine's speed cancels in the bracketed ratio
    order = timing.bracketed_order(["ddp", "compute-only", "a"], 2)
    assert order == [("compute-only", 0), ("ddp", 0), ("compute-only", 1), ("a", 0), ("compute-only", 2),
                     ("ddp", 1), ("compute-only", 3), ("a", 1), ("compute-only", 4)]
    assert timing.brackets(order, "a") == [(1, 2), (3, 4)] and timing.brackets(order, "ddp") == [(0, 1), (2, 3)]
    drifting = [3.0, 3.5, 4.0, 4.5, 5.0]  # the floor slows by 0.5 ms a run; "a" costs 1.1x wherever it runs
    steady = timing.bracketed_ratio([1.1 * 3.75, 1.1 * 4.75], drifting, timing.brackets(order, "a"))
    assert steady["median"] == pytest.approx(1.1, rel=2e-3) and steady["hi"] - steady["lo"] < 2e-3
    assert timing.bracketed_order(["compute-only", "a"], 1) == [("compute-only", 0), ("a", 0)]


def clean_copy(tmp_path) -> Path:
    """This package and its configs committed to a git repository of their own: a clean checkout, the only kind
    ``--resume`` accepts, of the code under test (uncommitted edits included)."""
    repo = tmp_path / "repo"
    for part in ("hooks", "configs"):
        shutil.copytree(REPO / part, repo / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "copy"]):
        subprocess.run(git + cmd, cwd=repo, check=True, capture_output=True)
    return repo


def test_seeds_held_out_time_windows_and_resume(tmp_path):
    """One quick run, then the same run stopped and resumed:

    * quality per seed and the mean, from full runs of every seed; the search seed's mean and the held-out
      seed's apart; every row carries the commit and its config's hash; the table says what it is under it;
    * time from windows of the schedule's first 10 steps (so a window syncs 3 times where the full run syncs 5),
      but over the whole schedule for a method named by ``--whole-schedule``;
    * ``--resume`` after a stop in seed 1's stage: the finished stages are read back (their files untouched),
      seed 1 runs again, the quality equals the unstopped run's; a stage finished at another commit is an error
      naming ``--resume`` and the commits."""
    repo = clean_copy(tmp_path)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"), PYTHONPATH=str(repo / "hooks"))
    argv = [sys.executable, "-m", "commhooks.cli", "bench", "--quick", "--seeds", "0,1", "--search-seeds", "0",
            "--time-steps", "10", "--methods", "compute-only,qsr,qsr-constant,qsr-power1,qsr-nosync,floor-hooks",
            "--whole-schedule", "qsr-nosync", "--out", str(out)]

    def run(*extra):
        return subprocess.run(argv + list(extra), cwd=repo, env=env, capture_output=True, text=True, timeout=300)

    first = run()
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    setup = results["setup"]
    assert setup["seeds"] == [0, 1] and setup["time_steps"] == 10 and setup["search_seeds"] == [0], setup
    assert setup["whole_schedule"] == ["qsr-nosync"] and setup["resumed"] is False, setup
    assert set(setup["stages"]) == {"time-unlimited", "seed0", "seed1"}, setup
    assert setup["cpu"]["capability"] in {"DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "SVE256"} and setup["cpu"]["model"], setup
    for name in ("qsr", "qsr-constant", "qsr-power1"):
        m = results["methods"][name]
        by_seed = m["quality_by_seed"]
        assert set(by_seed) == {"0", "1"} and by_seed["0"] == m["test_acc"], (name, m)
        assert m["quality_mean"] == pytest.approx((by_seed["0"] + by_seed["1"]) / 2)
        assert m["syncs"] == 5  # 20 steps, every period h_base 4 (all inside warmup_steps)
    assert any(m["quality_by_seed"]["0"] != m["quality_by_seed"]["1"] for m in results["methods"].values())
    whole = json.loads((out / "time-unlimited" / "qsr-nosync.rank0.json").read_text())
    assert whole["steps_run"] == 20, whole  # --whole-schedule: its timing runs go to the end
    window = json.loads((out / "time-unlimited" / "qsr.rank0.json").read_text())
    full = json.loads((out / "seed0" / "qsr.rank0.json").read_text())
    assert window["steps_run"] == 10 and window["syncs"] == 3 and full["steps_run"] == 20, (window, full)
    qsr = results["methods"]["qsr"]
    assert qsr["syncs"] == 5 and qsr["test_acc"] == full["test_acc"]
    assert qsr["quality_search_mean"] == qsr["quality_by_seed"]["0"]
    assert qsr["quality_heldout_mean"] == qsr["quality_by_seed"]["1"]
    assert qsr["commit"] == setup["commit"] and qsr["config_sha256"] == full["config_sha256"]
    text = (out / "table.md").read_text()
    assert "mean of search seeds 0" in text and "mean of held-out seeds 1" in text, text
    assert f"| {qsr['config_sha256'][:8]} |" in text and f"commit {setup['commit'][:7]}" in text, text
    assert "the schedule's first 10 steps (qsr-nosync: the whole schedule)" in text, text
    assert "chosen on seeds 0" in text, text
    # each commhooks method's time over its floor (its hooks, no sync: groups of 1 rank here), repeat by repeat
    over = qsr["ratios"]["unlimited"]["vs its floor"]
    assert over["floor"] == "floor-hooks" and over["repeats"] == 1 and over["median"] > 0, over
    assert "vs its floor" not in results["methods"]["floor-hooks"]["ratios"]["unlimited"]
    assert "vs its floor unlimited" in text and "(floor-hooks)" in text, text
    phases = json.loads((out / "phases.json").read_text())  # the step by phase, beside its floor's
    assert (out / "phases.png").is_file() and "phases.png" in results["plots"], results["plots"]
    row = phases["methods"]["qsr"]
    assert row["floor"] == "floor-hooks" and row["floor_total"] == phases["methods"]["floor-hooks"]["total"], row
    assert row["phases"]["compute"] > 0 and row["total"] == pytest.approx(sum(row["phases"].values())), row
    # two runs' phases side by side (two commits, in use): a phase made slower shows as its ratio
    slower = json.loads(json.dumps(results))
    slower["methods"]["qsr"]["phases"]["encode"]["ms_per_step"] += 2.0
    slower["setup"]["commit"] = "f" * 40
    (tmp_path / "after").mkdir()
    (tmp_path / "after" / "results.json").write_text(json.dumps(slower))
    compared = subprocess.run([sys.executable, "-m", "commhooks.cli", "bench", "--compare-phases", str(out),
                               str(tmp_path / "after")], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert compared.returncode == 0, compared.stderr
    lines = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in compared.stdout.splitlines()}
    old = qsr["phases"]["encode"]["ms_per_step"]
    assert f"| {old + 2.0:.3f} |" in lines[("qsr", "encode")] and "ffffff" in compared.stdout, compared.stdout
    assert lines[("qsr", "compute")].endswith("| 1.00x |"), compared.stdout

    (out / "seed1" / "done.json").unlink()  # as if stopped during seed 1
    kept = {f: f.stat().st_mtime_ns for f in (out / "time-unlimited").glob("*.rank0.json")}
    again = run("--resume")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "time-unlimited: finished earlier at this commit, reused (--resume)" in again.stdout
    assert "seed0: finished earlier" in again.stdout and "seed1: finished earlier" not in again.stdout
    assert {f: f.stat().st_mtime_ns for f in kept} == kept
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["setup"]["resumed"] is True
    for name, m in results["methods"].items():
        assert resumed["methods"][name]["quality_by_seed"] == m["quality_by_seed"], name
    done = out / "seed0" / "done.json"
    done.write_text(done.read_text().replace(setup["commit"], "0" * 40))
    other = run("--resume")
    assert other.returncode != 0 and "--resume:" in other.stderr and "commit 0000000" in other.stderr, \
        other.stderr[-1500:]


def test_a_timing_window_that_shared_the_machine_is_flagged():
    """A process the bench did not start (here one not yet reaped, so not counted as its own) burning a core
    during the window: ``others_cores`` counts it, ``shared`` flags it, the table says so."""
    from commhooks.tools.bench import cpu_clock, machine_load, provenance_line

    before = cpu_clock()
    burner = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                               "while time.process_time() - t < 1.5: pass"])
    time.sleep(2.0)  # the burner is done, but not reaped: its CPU is not yet the bench's children's
    load = machine_load(before, cpu_clock())
    burner.wait()
    assert load["others_cores"] >= 0.5 and load["shared"] is True, load
    setup = {"commit": "a" * 40, "dirty": False, "date": "2026-12-06", "load": {"100mbit": load}}
    assert "SHARED: other processes used the CPU during the timing at 100mbit" in provenance_line({"setup": setup})


def test_bad_bench_arguments_are_refused_naming_the_flag():
    for bad, flag in ((["--search-seeds", "0,1"], "--search-seeds"), (["--search-seeds", "3"], "--search-seeds"),
                      (["--time-steps", "5"], "--time-steps"), (["--repeats", "0"], "--repeats"),
                      (["--whole-schedule", "qsr,nope"], "--whole-schedule")):
        proc = subprocess.run([sys.executable, "-m", "commhooks.cli", "bench", "--quick", "--seeds", "0,1", *bad],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and f"error: {flag}" in proc.stderr.splitlines()[-1], (bad, proc.stderr[-500:])


def test_bad_seeds_are_refused_naming_the_flag():
    for bad in ("0,0", "a,1", ","):
        proc = subprocess.run([sys.executable, "-m", "commhooks.cli", "bench", "--quick", "--seeds", bad],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "error: --seeds" in proc.stderr.splitlines()[-1], (bad, proc.stderr[-500:])


def _syncs_over_schedule(config_file, model, steps):
    """QSR's syncs over the trainer's own warm-up + cosine schedule (the period rule the hook runs)."""
    import torch

    from commhooks.algorithms.qsr import qsr_period
    from commhooks.config import load_config
    from commhooks.tools import train

    args = train.parse_args(["--model", model, "--steps", str(steps)])
    conf = load_config(REPO / config_file)
    conf.total_steps = steps
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.lr)
    factor = train.cosine_with_warmup(optimizer, args.lr_warmup, steps).lr_lambdas[0]
    step = syncs = 0
    while step < steps:
        step += qsr_period(step, args.lr * factor(step), conf)
        syncs += 1
    return syncs


@pytest.mark.parametrize("model,steps,suffix", [("cnn", 1200, "mnist1d"), ("gpt", 300, "gpt")])
def test_comparison_rules_sync_at_least_as_often_as_qsr(model, steps, suffix):
    """The paper's claim is QSR's generalisation *at equal or fewer syncs*: the shipped constant-period and
    power-1 configs of each workload sync at least as often as its QSR config over the benchmark's schedule,
    and the power-1 one no more than 10 % more often (a fair, not a handicapped, comparison)."""
    qsr = _syncs_over_schedule(f"configs/qsr_{suffix}.json", model, steps)
    constant = _syncs_over_schedule(f"configs/qsr_constant_{suffix}.json", model, steps)
    power1 = _syncs_over_schedule(f"configs/qsr_power1_{suffix}.json", model, steps)
    assert constant > qsr and qsr <= power1 <= 1.1 * qsr, (qsr, constant, power1)


@pytest.mark.xdist_group("netns")  # each checks what namespaces are left: one at a time
def test_network_namespaces_and_tc(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    results, _, out = bench(["--methods", "ddp,qsr", "--steps", "30", "--repeats", "1", "--bandwidths", "unlimited,100mbit",
                             "--netns", "on"], tmp_path, timeout=600)
    assert results["setup"]["network"].startswith("netns")
    ddp, qsr = results["methods"]["ddp"], results["methods"]["qsr"]
    # the kernel's counters: at least the payload went over each rank's veth, plus headers (< 5 %)
    assert ddp["payload_bytes_per_rank"] <= ddp["wire_tx_bytes_per_rank"] < 1.05 * ddp["payload_bytes_per_rank"] + 2e5
    assert qsr["wire_tx_bytes_per_rank"] < ddp["wire_tx_bytes_per_rank"]
    # tc really throttled the link: a step cannot beat the transmission time of its payload at 100 Mbit/s
    transmit_ms = ddp["payload_bytes_per_rank"] / 30 * 8 / 100e6 * 1000
    assert ddp["step_ms"]["100mbit"] > 0.9 * transmit_ms > 30, (ddp["step_ms"], transmit_ms)
    assert "tbf 100mbit" in results["setup"]["shaping"]["100mbit"]
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "-hub" not in leftover, f"namespaces left behind: {leftover}"


@pytest.mark.xdist_group("netns")  # each checks what namespaces are left: one at a time
def test_nodes_share_one_link(tmp_path):
    """--nodes 2 with 4 ranks: the two ranks of a node share one namespace and one veth (they read the same
    counter), and their traffic to each other stays off it."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    results, _, _ = bench(["--methods", "ddp,compute-only", "--ranks", "4", "--nodes", "2", "--steps", "20", "--repeats", "1",
                             "--bandwidths", "unlimited", "--netns", "on"], tmp_path, timeout=600)
    assert results["setup"]["nodes"] == 2 and "2 nodes of 2 ranks" in results["setup"]["network"]
    per_rank = [json.loads((tmp_path / "time-unlimited" / f"ddp.rank{r}.json").read_text()) for r in range(4)]
    tx = [r["wire_bytes_per_rank"]["tx"] for r in per_rank]
    # ranks 0 and 1 read node 0's veth, ranks 2 and 3 node 1's: one counter each, read over the same run
    assert abs(tx[0] - tx[1]) < 0.1 * tx[0] and abs(tx[2] - tx[3]) < 0.1 * tx[2], tx
    ddp = results["methods"]["ddp"]
    assert ddp["wire_tx_bytes_per_node"] == pytest.approx(sum(tx) / 4)
    # a node's link carries its share of the 4-rank allreduce, not the intra-node part: less than two ranks'
    # full payload, more than nothing
    assert 0.3 * ddp["payload_bytes_per_rank"] < ddp["wire_tx_bytes_per_node"] < 2 * ddp["payload_bytes_per_rank"]
    assert results["methods"]["compute-only"]["wire_tx_bytes_per_node"] < 0.05 * ddp["wire_tx_bytes_per_node"]


# --------------------------------------------------------------------------
# the benchmark leaves nothing behind (root: CI runs as root)
# --------------------------------------------------------------------------


def _lab_leftovers(pid, out):
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    workers = subprocess.run(["pgrep", "-f", f"commhooks.tools.bench --worker {out}/time-100mbit/spec.json"],
                             capture_output=True, text=True).stdout.split()
    return ([n for n in namespaces.split() if n.startswith(f"chb{pid}-")]
            + [n for n in links.split() if f"chb{pid}" in n], workers)


@pytest.mark.xdist_group("netns")  # each checks what namespaces are left: one at a time
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the process group"])
def test_bench_cleans_up_on_a_signal(how, tmp_path):
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root; CI runs as root")
    out = REPO / ".cache" / f"bench-signal-{os.getpid()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", COMMHOOKS_CACHE=str(REPO / ".cache"))
    proc = subprocess.Popen([sys.executable, "-m", "commhooks.cli", "bench", "--methods", "ddp", "--steps", "100000", "--repeats", "1",
                             "--bandwidths", "100mbit", "--netns", "on", "--out", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            # a shell's background job ignores SIGINT, and children inherit that: give the benchmark
                            # the disposition a terminal's Ctrl-C meets, whoever started pytest
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        out_dir = out / "time-100mbit"  # the timing runs' folder
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the workers are up once their log says they train
            logs = list(out_dir.glob("worker-rank*.log")) if out_dir.exists() else []
            names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            if len(logs) == 2 and f"chb{proc.pid}-r1" in names and time.monotonic() > 0:
                time.sleep(8)  # let them get into training
                break
            time.sleep(0.5)
        else:
            pytest.fail("the benchmark's workers did not start")
        assert proc.poll() is None, proc.stdout.read()
        assert len(_lab_leftovers(proc.pid, out)[1]) >= 2, "the check must see the running workers"
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_lab_leftovers(proc.pid, out)):
            time.sleep(0.2)
        assert _lab_leftovers(proc.pid, out) == ([], []), _lab_leftovers(proc.pid, out)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.xdist_group("netns")  # each checks what namespaces are left: one at a time
def test_bench_removes_a_dead_runs_namespaces_but_not_a_live_ones(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root; CI runs as root")
    dead = 4194000  # above this machine's pid_max: no such process
    while os.path.exists(f"/proc/{dead}"):
        dead -= 1
    live = os.getpid()
    for name in (f"chb{dead}-r0", f"chb{live}-r0"):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        _, _, stdout = bench(["--methods", "ddp", "--steps", "3", "--repeats", "1", "--bandwidths", "unlimited", "--netns", "on"],
                             tmp_path, timeout=300)
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        assert f"chb{dead}-r0" not in names and f"removed what a dead earlier run left: chb{dead}-r0" in stdout
        assert f"chb{live}-r0" in names, "a live process's namespace must stay"
    finally:
        for name in (f"chb{dead}-r0", f"chb{live}-r0"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_pictures_of_a_multinode_run_plot_the_bytes_crossing_the_node_links(tmp_path):
    """The recorded GPT run (4 ranks, 2 nodes): the picture and the "vs DDP" column use the bytes on the node
    links (wire tx), not the payload including the in-node gradient means, which put qsr-int8-hier to the right
    of DDP; the payload stays in its own column."""
    import shutil

    from commhooks.tools import bench as bench_module

    recorded = REPO / "results" / "bench-gpt-hier-2026-12-04"
    shutil.copy(recorded / "results.json", tmp_path / "results.json")
    assert bench_module.main(["--replot", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    points = json.loads((tmp_path / "accuracy_vs_bytes.json").read_text())
    assert "crossing the node links, wire tx" in points["x"]
    for name, (x, _) in points["points"].items():
        assert x == results["methods"][name]["wire_tx_bytes_per_rank"], name
    hier, ddp = points["points"]["qsr-int8-hier"][0], points["points"]["ddp"][0]
    assert hier < 0.05 * ddp  # far to the left, as the wire counters say
    assert results["methods"]["qsr-int8-hier"]["payload_bytes_per_rank"] > results["methods"]["ddp"]["payload_bytes_per_rank"]
    md = (tmp_path / "table.md").read_text()
    assert "| payload/rank (incl. in-node) | vs DDP (cross-node) |" in md
    assert [r for r in md.splitlines() if r.startswith("| qsr-int8-hier |")][0].split(" | ")[5] == "0.025"
    for png in ("accuracy_vs_bytes.png", "time_vs_bandwidth.png"):
        assert (tmp_path / png).stat().st_size > 10_000


def test_engine_fsdp_runs_every_method_on_fsdp2_but_pytorchs_own_ddp_hooks():
    from commhooks.tools.bench import method_argv

    assert method_argv("ddp", "gpt", "fsdp")[-2:] == ["--backend", "fsdp"]  # FSDP2's own HSDP
    assert method_argv("qsr-int2-hier", "gpt", "fsdp")[-2:] == ["--backend", "fsdp"]
    for anchor in ("compute-only", "powersgd-r4", "fp16"):
        assert "--backend" not in method_argv(anchor, "gpt", "fsdp"), anchor
    assert "--backend" not in method_argv("qsr-int2-hier", "gpt")
