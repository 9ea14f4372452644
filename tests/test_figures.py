"""The bench's pictures (commhooks.tools.figures): the plotted values and bar ends in the JSON beside them, no bar
where one seed or one repeat gives none, and names that do not overlap.  Hand-made results, no run."""

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.axes  # noqa: E402
import matplotlib.figure  # noqa: E402
import matplotlib.text  # noqa: E402
import pytest  # noqa: E402

from commhooks.tools import figures, timing  # noqa: E402

PACES = {  # 5 repeats of each method's pace (ms) at each link setting
    "ddp": {"unlimited": [9.1, 9.4, 8.8, 9.9, 9.2], "100mbit": [74.0, 75.5, 74.8, 76.1, 74.9]},
    "compute-only": {"unlimited": [5.2, 5.6, 5.1, 5.3, 6.0], "100mbit": [5.3, 5.2, 5.9, 5.4, 5.5]},
    "qsr-a": {"unlimited": [6.1, 6.3, 6.0, 6.8, 6.2], "100mbit": [7.1, 7.3, 7.0, 7.9, 7.2]},
    "qsr-b": {"unlimited": [6.4, 6.2, 6.5, 6.6, 7.4], "100mbit": [7.4, 7.2, 7.6, 7.5, 8.8]},
}
QUALITY = {"ddp": [0.913, 0.916, 0.929], "compute-only": [0.902, 0.913, 0.914], "qsr-a": [0.932, 0.943, 0.941],
           "qsr-b": [0.913, None, None]}  # qsr-b: one seed finished
PAYLOAD = {"ddp": 8.9e8, "compute-only": 0.0, "qsr-a": 2.02e6, "qsr-b": 2.05e6}


def make_results(paces=True, seeds=(0, 1, 2), quality=None, payload=None, bandwidths=("unlimited", "100mbit")):
    quality, payload = quality or QUALITY, payload or PAYLOAD
    methods = {}
    for name, by_seed in quality.items():
        values = [v for v in by_seed if v is not None]
        m = {"test_acc": by_seed[0], "payload_bytes_per_rank": payload[name],
             "quality_by_seed": {str(s): v for s, v in zip(seeds, by_seed)},
             "quality_mean": statistics.fmean(values) if len(values) == len(seeds) else None,
             "step_ms": {bw: statistics.median(PACES.get(name, PACES["qsr-a"])[bw]) for bw in bandwidths}}
        if paces:
            m["step_ms_paces"] = {bw: PACES.get(name, PACES["qsr-a"])[bw] for bw in bandwidths}
        methods[name] = m
    setup = {"ranks": 2, "nodes": 1, "steps": 1200, "model": "cnn", "seeds": list(seeds), "repeats": 5,
             "bandwidths": list(bandwidths), "network": "netns + veth + bridge, tc per rank", "date": "2026-12-07",
             "commit": "0123456789abcdef", "dirty": False}
    return {"setup": setup, "methods": methods}


def draw(results, out: Path):
    return figures.plots(results, out, metric="test_acc", x_of=lambda m: m["payload_bytes_per_rank"],
                         x_label="payload sent per rank over the run (MB, log)", heading="MNIST-1D CNN, 2 ranks",
                         link="link per rank", ours={"qsr-a", "qsr-b"})


@pytest.fixture
def drawn(monkeypatch):
    """Every errorbar call's (y values, yerr, xerr), and the placed labels' boxes of each saved figure."""
    calls, saved = [], []
    errorbar, savefig = matplotlib.axes.Axes.errorbar, matplotlib.figure.Figure.savefig

    def record_errorbar(self, x, y, *args, **kwargs):
        calls.append({"x": list(x), "y": list(y), "yerr": kwargs.get("yerr"), "xerr": kwargs.get("xerr"),
                      "horizontal": "xerr" in kwargs, "color": kwargs.get("color")})
        return errorbar(self, x, y, *args, **kwargs)

    def record_savefig(self, path, *args, **kwargs):
        self.canvas.draw()
        renderer = self.canvas.get_renderer()
        # the text's own box (an annotation's extent would hold its leader line too)
        labels = [(t.get_text(), matplotlib.text.Text.get_window_extent(t, renderer)) for ax in self.axes
                  for t in ax.texts]
        saved.append({"path": Path(path).name, "labels": labels, "ax": self.axes[0].get_window_extent(renderer)})
        return savefig(self, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", record_errorbar)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record_savefig)
    return calls, saved


def test_files_and_the_plotted_values_with_their_bar_ends(tmp_path, drawn):
    calls, _ = drawn
    assert draw(make_results(), tmp_path) == ["accuracy_vs_bytes.png", "time_vs_bandwidth.png"]
    for png in ("accuracy_vs_bytes.png", "time_vs_bandwidth.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / png).stat().st_size > 10_000
    quality = json.loads((tmp_path / "accuracy_vs_bytes.json").read_text())
    assert quality["points"]["qsr-a"] == [2.02e6, pytest.approx((0.932 + 0.943 + 0.941) / 3)]
    assert quality["bars"]["qsr-a"] == [0.932, 0.943] and quality["bars"]["ddp"] == [0.913, 0.929]
    assert "compute-only" not in quality["points"]  # no byte: no point on a log axis, but its line
    assert quality["baselines"]["compute-only"] == pytest.approx((0.902 + 0.913 + 0.914) / 3)
    assert "min-max over seeds" in quality["note"] and "mean of 3 seeds" in quality["y"]
    times = json.loads((tmp_path / "time_vs_bandwidth.json").read_text())
    for name, by_bw in PACES.items():
        for bw, paces in by_bw.items():
            cell = times["methods"][name][bw]
            median, lo, hi = timing.median_interval(paces)
            assert (cell["median"], cell["lo"], cell["hi"], cell["repeats"]) == (median, lo, hi, 5)
            assert lo < median < hi or lo <= median <= hi and lo < hi, (name, bw, cell)
    # what was drawn is what the JSON says: qsr-a's bar from its lowest seed to its highest
    bar = next(c for c in calls if c["y"] == [quality["points"]["qsr-a"][1]])
    assert bar["yerr"][0][0] == pytest.approx(quality["points"]["qsr-a"][1] - 0.932)
    assert bar["yerr"][1][0] == pytest.approx(0.943 - quality["points"]["qsr-a"][1])
    timed = [c for c in calls if c["y"] == [times["methods"]["ddp"][bw]["median"] for bw in ("unlimited", "100mbit")]]
    assert timed and timed[0]["yerr"] is not None


def test_a_method_with_one_seed_has_no_bar(tmp_path, drawn):
    calls, _ = drawn
    draw(make_results(), tmp_path)
    quality = json.loads((tmp_path / "accuracy_vs_bytes.json").read_text())
    assert quality["bars"]["qsr-b"] is None and quality["points"]["qsr-b"][1] == 0.913
    drawn_b = [c for c in calls if c["y"] == [0.913] and c["color"] == figures.PALETTE[1]]  # qsr-b's colour
    assert drawn_b and all(c["yerr"] is None for c in drawn_b)
    one = make_results(seeds=(0,), quality={n: v[:1] for n, v in QUALITY.items()})
    draw(one, tmp_path)
    quality = json.loads((tmp_path / "accuracy_vs_bytes.json").read_text())
    assert all(b is None for b in quality["bars"].values()) and quality["note"] == "one seed: no bar"


def test_an_old_results_file_without_repeats_is_drawn_without_time_bars(tmp_path, drawn):
    calls, saved = drawn
    old = make_results(paces=False, bandwidths=("100mbit",))
    for m in old["methods"].values():
        del m["quality_by_seed"], m["quality_mean"]  # recorded before seeds were kept, too
    old["setup"].pop("commit"), old["setup"].pop("seeds")
    draw(old, tmp_path)
    times = json.loads((tmp_path / "time_vs_bandwidth.json").read_text())
    assert times["methods"]["ddp"]["100mbit"] == {"median": 74.9, "lo": None, "hi": None, "repeats": None}
    quality = json.loads((tmp_path / "accuracy_vs_bytes.json").read_text())
    assert quality["points"]["qsr-a"][1] == 0.932 and quality["bars"]["qsr-a"] is None  # seed 0's figure
    time_calls = [c for c in calls if c["horizontal"]]  # the dot plot's rows
    assert len(time_calls) == 4 and all(c["xerr"] is None for c in time_calls)
    texts = [t for s in saved for t, _ in s["labels"]]
    assert "74.90" in texts  # the dot plot prints each median, with no interval


def test_held_out_seeds_are_plotted_and_said(tmp_path, drawn):
    seeds = (0, 1, 2, 3, 4, 5)
    quality = {"ddp": [0.91, 0.92, 0.93, 0.90, 0.92, 0.94], "compute-only": [0.90, 0.91, 0.91, 0.90, 0.89, 0.92],
               "qsr-a": [0.95, 0.95, 0.96, 0.90, 0.91, 0.93]}  # chosen on 0-2, where it shines
    results = make_results(seeds=seeds, quality=quality)
    results["setup"]["search_seeds"] = [0, 1, 2]
    results["methods"]["ddp"]["quality_heldout_mean"] = statistics.fmean([0.90, 0.92, 0.94])
    draw(results, tmp_path)  # qsr-a has no stored held-out mean: computed from its seeds 3-5
    q = json.loads((tmp_path / "accuracy_vs_bytes.json").read_text())
    assert "held-out seeds 3/4/5" in q["y"] and "chose on seeds 0/1/2" in q["note"]
    assert q["points"]["qsr-a"][1] == pytest.approx(statistics.fmean([0.90, 0.91, 0.93]))
    assert q["bars"]["qsr-a"] == [0.90, 0.93] and q["bars"]["ddp"] == [0.90, 0.94]
    assert q["points"]["ddp"][1] == pytest.approx(0.92)


def test_names_do_not_overlap_each_other_or_leave_the_axes(tmp_path, drawn):
    """Eight methods within a few percent of each other's bytes and accuracy: every label is inside the axes
    and no two labels' boxes overlap (names where there is room, else numbers and a key)."""
    _, saved = drawn
    names = [f"qsr-diloco-int2-variant-{i}" for i in range(8)]
    quality = {"ddp": [0.91, 0.92, 0.93], "compute-only": [0.90, 0.91, 0.91]}
    quality.update({n: [0.930 + 0.002 * i, 0.935 + 0.002 * i, 0.94 + 0.001 * i] for i, n in enumerate(names)})
    payload = {"ddp": 8.9e8, "compute-only": 3e5, **{n: 2.0e6 * (1 + 0.01 * i) for i, n in enumerate(names)}}
    draw(make_results(quality=quality, payload=payload), tmp_path)
    q = json.loads((tmp_path / "accuracy_vs_bytes.json").read_text())
    picture = next(s for s in saved if s["path"] == "accuracy_vs_bytes.png")
    assert q["labels"] != "overlapping"
    boxes = picture["labels"]  # a name, or a number the key below the axes names
    numbers = {str(i + 1): n for i, n in enumerate(q["points"])}
    assert sorted(numbers.get(t, t) for t, _ in boxes) == sorted(q["points"])  # each point labelled once
    ax = picture["ax"]
    for i, (t, a) in enumerate(boxes):
        assert ax.x0 <= a.x0 and a.x1 <= ax.x1 and ax.y0 <= a.y0 and a.y1 <= ax.y1, t
        for u, b in boxes[i + 1:]:
            assert not figures._overlaps(a, b), (t, u)


def test_dated_subtitle_with_the_commit():
    assert figures.subtitle(make_results()) == "run of 2026-12-07, commit 0123456"
    results = make_results()
    results["setup"].update(dirty=True)
    assert figures.subtitle(results).endswith("with local changes")
    del results["setup"]["commit"]
    assert figures.subtitle(results) == "run of 2026-12-07, commit not recorded"
