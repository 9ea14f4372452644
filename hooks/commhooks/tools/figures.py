"""The benchmark's two pictures, with error bars and labels that do not collide.

``accuracy_vs_bytes.png``: each method's quality (test accuracy or validation loss) against the bytes it sent
(log), a vertical bar over seeds.  ``time_vs_bandwidth.png``: each method's time per optimizer step at each
link setting, a bar over the timing repeats.  Beside each picture a JSON file holds what it plots, bar ends
included, so a sentence quoting a picture can be checked against numbers rather than pixels.

This module draws; it runs nothing, and it does not import :mod:`commhooks.tools.bench` (the layer test counts
imports inside functions too, so a lazy import back would still be a cycle).  The bench's facts about a run
(which quality column, which bytes are compared, the title, which methods are commhooks') arrive as arguments.

**The quality bar is the min-max over seeds, not a confidence interval.**  The bench runs 3 seeds; a 95 %
Student-t interval of a 3-seed mean is ``mean +- 4.30 s / sqrt(3) = mean +- 2.5 s`` (s the seeds' standard
deviation), about 2.5 times as wide as the seeds' own range is on average, and it rests on a normality nobody
can check on 3 values.  It would draw every MNIST-1D method's bar over half the picture and hide the
differences that do repeat seed by seed.  The min-max is what was measured, with no model: it says how far one
seed moved the figure, and a reader can see at a glance whether two methods' seeds overlap.  It is not a
statement about the mean: with 3 seeds a fourth seed falls outside the range half the time ((n-1)/(n+1) = 1/2
inside).  Where a search chose a configuration on some seeds (``setup["search_seeds"]``), the plotted figure
is the mean over the other, held-out seeds and the bar their range; the axis label says so.

**The time bar is a 95 % bootstrap interval of the median** pace over the interleaved repeats
(:func:`commhooks.tools.timing.median_interval`, the interval the table prints for the ratios).  A run with one
repeat, or recorded before repeats were kept (no ``step_ms_paces``), is drawn without a bar.

Labels: each point's name goes beside it by a greedy pass that tries offsets around the point, nearest first,
and keeps the first whose box overlaps no other label, marker or bar and stays inside the axes (a thin leader
line where it had to move away, and no label over a leader line).  A point whose name finds no place is
numbered instead, and a key below the axes names it.  With one link setting the time picture is a dot plot (a row per method, its name
on the axis), so no label can collide there; with several, a line per method and the legend below the axes.
"""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from pathlib import Path
from typing import Callable, Collection, Dict, List, Optional, Sequence, Tuple

from . import timing

BASELINES = ("ddp", "compute-only")  # drawn apart: black and grey squares, a dotted line at their quality
WIDTH_IN = 8.0  # shown about 800 px wide in the docs: 9-10 pt text stays about 12-14 px there
DPI = 150
# tab10 without its grey (compute-only's), then tab20's lighter tints of the same hues
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
           "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5"]
QUALITY_NOTE = "bar: min-max over seeds"
TIME_NOTE = "bar: 95 % bootstrap interval of the median over repeats"


# ---------------------------------------------------------------- the plotted values (no matplotlib)

def plotted_seeds(results: dict) -> Tuple[List[int], List[int]]:
    """(the seeds the quality picture averages, the seeds a search chose on): held-out seeds where the setup
    names ``search_seeds``, else every seed."""
    setup = results["setup"]
    seeds = list(setup.get("seeds") or [setup.get("seed", 0)])
    search = list(setup.get("search_seeds") or [])
    return ([s for s in seeds if s not in search] if search else seeds), search


def seed_values(m: dict, seeds: Sequence[int]) -> List[float]:
    """A method's recorded quality on each of ``seeds`` that has one."""
    by_seed = m.get("quality_by_seed") or {}
    return [by_seed[str(s)] for s in seeds if by_seed.get(str(s)) is not None]


def quality_data(results: dict, metric: str, x_of: Callable[[dict], Optional[float]], x_label: str) -> dict:
    """What ``accuracy_vs_bytes.png`` plots.  ``points``: per method ``[bytes, quality]`` (the keys and form of
    the bench's earlier ``accuracy_points``); ``bars``: per method ``[low, high]``, the min and max over the
    plotted seeds, or None where fewer than two seeds have a figure; ``by_seed``: those seeds' values;
    ``baselines``: the baselines' quality (each drawn as a dotted line), also where they sent no byte and so
    have no point on the log axis."""
    seeds, search = plotted_seeds(results)
    heldout = bool(search)
    points, bars, by_seed, lines = {}, {}, {}, {}
    for name, m in results["methods"].items():
        values = seed_values(m, seeds)
        if heldout:
            y = m.get("quality_heldout_mean")
            if y is None and values:
                y = statistics.fmean(values)  # a method recorded before the held-out mean was kept
        else:
            y = m.get("quality_mean")
            if y is None:
                y = m.get(metric)  # one seed (or a run recorded before the seeds' mean)
        if y is None:
            continue
        if name in BASELINES:
            lines[name] = y
        x = x_of(m)
        if not x:
            continue  # no byte sent: nowhere on a log axis (a baseline keeps its line)
        points[name] = [x, y]
        by_seed[name] = {str(s): (m.get("quality_by_seed") or {}).get(str(s)) for s in seeds}
        bars[name] = [min(values), max(values)] if len(values) > 1 else None
    what = "test accuracy" if metric == "test_acc" else "validation loss (nats/byte)"
    if heldout:
        y_label = f"{what}, mean of held-out seeds {'/'.join(map(str, seeds))}"
        note = (f"{QUALITY_NOTE}; held-out seeds: the search chose on seeds {'/'.join(map(str, search))}, "
                "the picture shows the others")
    elif len(seeds) > 1:
        y_label = f"{what}, mean of {len(seeds)} seeds"
        note = QUALITY_NOTE
    else:
        y_label, note = what, "one seed: no bar"
    return {"x": x_label, "y": y_label, "note": note, "seeds": seeds, "search_seeds": search or None,
            "points": points, "bars": bars, "by_seed": by_seed, "baselines": lines}


def time_data(results: dict) -> dict:
    """What ``time_vs_bandwidth.png`` plots: per method and link setting the median pace (``step_ms``, the median
    of ``step_ms_paces`` where those are recorded), the ends
    of its 95 % bootstrap interval over the repeats (None with one repeat, or in a run recorded without
    ``step_ms_paces``) and the number of repeats (None where not recorded)."""
    bws = list(results["setup"]["bandwidths"])
    methods = {}
    for name, m in results["methods"].items():
        row = {}
        for bw in bws:
            median = m["step_ms"].get(bw)
            if median is None:
                continue
            paces = (m.get("step_ms_paces") or {}).get(bw)
            lo = hi = None
            if paces and len(paces) > 1:  # the bar's centre is the median it is the interval of (the bench's
                median, lo, hi = timing.median_interval(paces)  # step_ms; a hand-edited file may differ)
            row[bw] = {"median": median, "lo": lo, "hi": hi, "repeats": len(paces) if paces else None}
        methods[name] = row
    return {"y": "time per optimizer step (ms)", "bandwidths": bws, "note": TIME_NOTE, "methods": methods}


def subtitle(results: dict) -> str:
    """``run of 2026-12-06, commit 5b64908``: the run's date and commit (with local changes where recorded)."""
    setup = results["setup"]
    commit, dirty = setup.get("commit"), setup.get("dirty")  # the bench spreads provenance.commit() into the setup
    text = f"run of {setup.get('date', 'an unrecorded date')}, "
    text += f"commit {commit[:7]}" + (" with local changes" if dirty else "") if commit else "commit not recorded"
    return text


# ---------------------------------------------------------------- drawing

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _style(name: str, index: int, ours: Collection[str]) -> dict:
    """One method's colour and marker, the same in both pictures: baselines black (DDP) and grey (compute-only)
    squares; commhooks' methods filled circles; other hooks (PyTorch's, the papers' anchors) triangles."""
    if name == "ddp":
        return {"color": "black", "marker": "s", "linestyle": "--"}
    if name == "compute-only":
        return {"color": "0.5", "marker": "s", "linestyle": "--"}
    colour = PALETTE[index % len(PALETTE)]
    return {"color": colour, "marker": "o" if name in ours else "^", "linestyle": "-" if name in ours else ":"}


def _colour_index(names: Sequence[str]) -> Dict[str, int]:
    others = [n for n in names if n not in BASELINES]
    return {n: i for i, n in enumerate(others)}


def _headings(fig, ax, heading: str, sub: str) -> None:
    fig.suptitle("\n".join(textwrap.wrap(heading, 80)), fontsize=11)
    ax.set_title(sub, fontsize=9, color="0.35")


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


# offsets tried around a point (points; nearest first, right of the point before left)
_DIRECTIONS = [(1, 0), (1, 0.6), (1, -0.6), (0, 1), (0, -1), (-1, 0), (-1, 0.6), (-1, -0.6),
               (1, 1.6), (1, -1.6), (-1, 1.6), (-1, -1.6), (0.3, 1), (-0.3, 1), (0.3, -1), (-0.3, -1)]
_RADII = [5, 10, 17, 26, 38, 52, 70, 90]


def place_labels(fig, ax, anchors: Dict[str, Tuple[float, float]], texts: Dict[str, str], avoid: list,
                 fontsize: float = 9, colours: Optional[Dict[str, object]] = None,
                 tries: int = 4, loose: bool = False) -> Tuple[dict, List[str]]:
    """Put ``texts[name]`` beside ``anchors[name]`` (data coordinates) where its box overlaps no label placed
    before, no box in ``avoid`` (display coordinates: markers, bars) and stays inside the axes.  Returns the
    annotations placed and the names that found no place (left undrawn).  The figure's layout must be final.

    Greedy, in an order: names before numbers (a number fits where a name does not), crowded points first (the
    one with the most neighbours has the fewest free places).  Where some label finds no place, it is tried
    again with those labels first, up to ``tries`` orders; the order that leaves the fewest out is kept.
    ``loose``: a leader line may cross markers and bars (never a label), for a last try in a crowd."""
    order = sorted(anchors, key=lambda n: (texts[n].isdigit(), -sum(
        abs(math.log10(anchors[n][0] / anchors[o][0])) < 0.3 for o in anchors), anchors[n][1]))
    best = None
    for _ in range(tries):
        placed, failed = _place_in_order(fig, ax, order, anchors, texts, avoid, fontsize, colours or {}, loose)
        if best is None or len(failed) < len(best[1]):
            if best is not None:
                _clear(best[0])
            best = (placed, failed)
        else:
            _clear(placed)
        if not best[1]:
            break
        order = failed + [n for n in order if n not in failed]
    return best


def _place_in_order(fig, ax, order, anchors, texts, avoid, fontsize, colours, loose) -> Tuple[dict, List[str]]:
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    placed, boxes, leaders, failed = {}, [], [], []
    for name in order:
        for radius in _RADII:
            done = False
            for dx, dy in _DIRECTIONS:
                norm = math.hypot(dx, dy)
                off = (radius * dx / norm, radius * dy / norm)
                ha = "left" if dx > 0 else "right" if dx < 0 else "center"
                va = "bottom" if dy > 0.3 else "top" if dy < -0.3 else "center"
                style = {"ha": ha, "va": va, "fontsize": fontsize, "color": colours.get(name, "black"), "zorder": 5,
                         "bbox": {"boxstyle": "square,pad=0.05", "fc": "white", "ec": "none", "alpha": 0.75}}
                ann = ax.annotate(texts[name], anchors[name], xytext=off, textcoords="offset points", **style)
                box = ann.get_window_extent(renderer).padded(2)
                point = ax.transData.transform(anchors[name])
                leader = (point, (min(max(point[0], box.x0), box.x1), min(max(point[1], box.y0), box.y1)))
                fits = (box.x0 >= inside.x0 and box.x1 <= inside.x1 and box.y0 >= inside.y0 and box.y1 <= inside.y1
                        and not any(_overlaps(box, b) for b in boxes + avoid)
                        and not any(_crosses(seg, box) for seg in leaders)  # no label over a leader line
                        and (radius == _RADII[0] or not any(_crosses(leader, b) for b in boxes)
                             and (loose or not any(_crosses(leader, b) for b in avoid))))  # nor along its bar
                if not fits:
                    ann.remove()
                    continue
                if radius > _RADII[0]:  # moved away from its point: a leader line back to it
                    ann.remove()
                    ann = ax.annotate(texts[name], anchors[name], xytext=off, textcoords="offset points", **style,
                                      arrowprops={"arrowstyle": "-", "color": style["color"], "lw": 0.6,
                                                  "shrinkA": 0, "shrinkB": 4, "alpha": 0.7})
                placed[name], done = ann, True
                boxes.append(box)
                if radius > _RADII[0]:
                    leaders.append(leader)
                break
            if done:
                break
        else:
            failed.append(name)
    return placed, failed


def _crosses(segment, box, skip: float = 9.0) -> bool:
    """Whether the segment (display points, from a point to its label) passes through ``box``, its first
    ``skip`` pixels left out (they lie on the point's own marker)."""
    (x0, y0), (x1, y1) = segment
    length = math.hypot(x1 - x0, y1 - y0)
    if length <= skip:
        return False
    steps = max(int(length / 2), 2)
    start = skip / length
    for k in range(steps + 1):
        t = start + (1 - start) * k / steps
        if box.contains(x0 + t * (x1 - x0), y0 + t * (y1 - y0)):
            return True
    return False


def _clear(annotations: dict) -> None:
    for ann in annotations.values():
        ann.remove()


def dodge(xs: Dict[str, float], ys: Dict[str, float], step: float, near: float = 0.06,
          widest: float = 0.15) -> Dict[str, float]:
    """Points whose x lie within ``near`` decades of each other, set side by side ``step`` decades apart (in the
    order of their y; a group spread over at most ``widest`` decades), so that their markers and bars do not sit
    on top of each other.  Drawing only: the JSON keeps the true bytes."""
    order = sorted(xs, key=lambda n: xs[n])
    clusters, moved = [], {}
    for name in order:
        if clusters and math.log10(xs[name]) - math.log10(xs[clusters[-1][-1]]) < near:
            clusters[-1].append(name)
        else:
            clusters.append([name])
    for group in clusters:
        centre = 10 ** statistics.fmean(math.log10(xs[n]) for n in group)
        apart = min(step, widest / max(len(group) - 1, 1))  # a crowd is drawn no wider than ``widest``
        for j, name in enumerate(sorted(group, key=lambda n: ys[n])):
            moved[name] = centre * 10 ** ((j - (len(group) - 1) / 2) * apart) if len(group) > 1 else xs[name]
    return moved


def _number_format(v, _pos=None) -> str:
    return f"{v:g}"


def _plain_log_axis(axis) -> None:
    """Ticks at 1, 2, 5 times the powers of ten, written as plain numbers (10, 20, 50; 0.1, 0.2, 0.5); at the
    powers of ten only where the axis spans more than 3 of them (their labels would run into each other), and at
    every other one beyond 7.  Call it once the axis's limits are set."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    decades = math.log10(hi / lo) if lo > 0 else 0.0
    subs = (1.0, 2.0, 5.0) if decades <= 3 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=6 if decades > 7 else 12))
    axis.set_major_formatter(FuncFormatter(_number_format))
    axis.set_minor_formatter(NullFormatter())


def draw_quality(data: dict, path: Path, heading: str, sub: str, ours: Collection[str] = ()) -> str:
    """Draw ``accuracy_vs_bytes.png`` from :func:`quality_data`; returns how the points are labelled: ``"names"``;
    ``"names and numbers"`` or ``"numbers"`` where some names found no room (those points numbered, a key below
    the axes names them); ``"overlapping"`` where even a number did not fit."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    points, bars = data["points"], data["bars"]
    index = _colour_index(list(points))
    styles = {n: _style(n, index.get(n, 0), ours) for n in points}
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 5.4))
    for name, y in data["baselines"].items():
        ax.axhline(y, color=_style(name, 0, ours)["color"], linestyle=":", linewidth=1, zorder=1)
    xs = {n: x / 1e6 for n, (x, _) in points.items()}
    ys = {n: y for n, (_, y) in points.items()}
    lo_x, hi_x = min(xs.values(), default=1.0), max(xs.values(), default=1.0)
    span_decades = math.log10(hi_x / lo_x) + 0.7  # the x range drawn (a third of a decade either side)
    drawn = dodge(xs, ys, step=0.011 * span_decades)
    for name in points:
        st, bar, y = styles[name], bars.get(name), ys[name]
        yerr = None if bar is None else [[y - bar[0]], [bar[1] - y]]
        base = name in BASELINES
        ax.errorbar([drawn[name]], [y], yerr=yerr, fmt=st["marker"], color=st["color"], markersize=7 if base else 6,
                    capsize=3, elinewidth=1.1, markeredgecolor="black" if base else "white", markeredgewidth=0.6,
                    zorder=3)
    ax.set_xscale("log")
    ax.set_xlabel(data["x"], fontsize=10)
    ax.set_ylabel("\n".join(textwrap.wrap(data["y"], 48)), fontsize=10)
    ax.grid(alpha=0.3, which="major")
    every_y = list(ys.values()) + [v for b in bars.values() if b for v in b] + list(data["baselines"].values())
    every_y = every_y or [0.0, 1.0]
    span = (max(every_y) - min(every_y)) or abs(max(every_y)) * 0.05 or 1.0
    ax.set_xlim(lo_x / 10 ** 0.35, hi_x * 10 ** 0.35)
    _plain_log_axis(ax.xaxis)
    ax.set_ylim(min(every_y) - 0.1 * span, max(every_y) + 0.1 * span)  # room for labels above and below
    _headings(fig, ax, heading, sub)
    handles = [Line2D([], [], linestyle=":", marker="s", color="black", label="ddp (baseline)"),
               Line2D([], [], linestyle=":", marker="s", color="0.5", label="compute-only (baseline, never syncs)")]
    handles = [h for h, n in zip(handles, BASELINES) if n in data["baselines"]]
    kinds = {st["marker"] for n, st in styles.items() if n not in BASELINES}
    if "o" in kinds:
        handles.append(Line2D([], [], linestyle="none", marker="o", color="0.3", label="commhooks"))
    if "^" in kinds:
        handles.append(Line2D([], [], linestyle="none", marker="^", color="0.3", label="other hooks"))

    def layout(key: Optional[str]) -> None:
        """The legend below the axes, its title the note on the bars (and the key, numbering the points)."""
        title = data["note"] if key is None else data["note"] + "\n" + key
        legend = ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=max(1, len(handles)),
                           fontsize=8.5, frameon=False, handlelength=2.2, title=title, title_fontsize=8.5)
        legend.get_title().set_color("0.25")
        fig.tight_layout()
        fig.canvas.draw()

    def avoid() -> list:
        """Display boxes of every marker and bar, which no label may cover."""
        boxes = []
        for name in points:
            cx, cy = ax.transData.transform((drawn[name], ys[name]))
            boxes.append(_box(cx - 6, cy - 6, cx + 6, cy + 6))
            if bars.get(name):
                _, lo = ax.transData.transform((drawn[name], bars[name][0]))
                _, hi = ax.transData.transform((drawn[name], bars[name][1]))
                boxes.append(_box(cx - 5, lo - 2, cx + 5, hi + 2))
        return boxes

    anchors = {n: (drawn[n], ys[n]) for n in points}
    colours = {n: st["color"] for n, st in styles.items()}
    numbers = {n: str(i + 1) for i, n in enumerate(points)}
    numbered: List[str] = []  # the points that found no room for their name: a number, and the key names them
    for _ in range(len(points) + 1):
        layout(_wrap_key([f"{numbers[n]} {n}" for n in points if n in numbered], 100) if numbered else None)
        texts = {n: numbers[n] if n in numbered else n for n in points}
        placed, failed = place_labels(fig, ax, anchors, texts, avoid(), colours=colours)
        named_failed = [n for n in failed if n not in numbered]
        if not named_failed:
            break
        _clear(placed)  # the key changes the layout: place all again, these numbered too
        numbered += named_failed
    if failed:  # a last try for those numbers: their leader lines may cross other points' bars
        from matplotlib.text import Text

        renderer = fig.canvas.get_renderer()
        for a in placed.values():
            a.update_positions(renderer)  # the text's box where it is drawn (not counting its leader line)
        taken = [Text.get_window_extent(a, renderer).padded(2) for a in placed.values()]
        _, failed = place_labels(fig, ax, {n: anchors[n] for n in failed}, {n: numbers[n] for n in failed},
                                 avoid() + taken, colours=colours, loose=True)
    for name in failed:  # not even a number finds room: beside its point, overlapping (the key names it)
        ax.annotate(numbers[name], anchors[name], xytext=(4, 3), textcoords="offset points", fontsize=9,
                    color=colours[name], zorder=5)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    if failed:
        return "overlapping"
    return "numbers" if len(numbered) == len(points) else "names and numbers" if numbered else "names"


def _box(x0, y0, x1, y1):
    from matplotlib.transforms import Bbox

    return Bbox([[x0, y0], [x1, y1]])


def _wrap_key(entries: List[str], width: int) -> str:
    lines, line = [], ""
    for e in entries:
        if line and len(line) + 3 + len(e) > width:
            lines.append(line)
            line = ""
        line = f"{line}   {e}" if line else e
    return "\n".join(lines + [line])


def draw_time(data: dict, path: Path, heading: str, sub: str, link: str, ours: Collection[str] = ()) -> None:
    """Draw ``time_vs_bandwidth.png`` from :func:`time_data`: one link setting, a dot plot (a row per method, the
    fastest on top, its median and interval printed at the right); several, a line per method across them with
    the legend below the axes.  ``link``: what a link setting limits (the x label)."""
    plt = _pyplot()
    methods, bws = data["methods"], data["bandwidths"]
    index = _colour_index(list(methods))
    barred = any(c["lo"] is not None for row in methods.values() for c in row.values())
    note = TIME_NOTE if barred else "no bars: one repeat per method, or a run recorded without its repeats"
    if len(bws) == 1:
        bw = bws[0]
        rows = sorted((n for n in methods if bw in methods[n]), key=lambda n: methods[n][bw]["median"], reverse=True)
        fig, ax = plt.subplots(figsize=(WIDTH_IN, 1.9 + 0.34 * len(rows)))
        for i, name in enumerate(rows):
            c, st = methods[name][bw], _style(name, index.get(name, 0), ours)
            xerr = None if c["lo"] is None else [[c["median"] - c["lo"]], [c["hi"] - c["median"]]]
            ax.errorbar([c["median"]], [i], xerr=xerr, fmt=st["marker"], color=st["color"], capsize=3, markersize=6,
                        elinewidth=1.1)
            cell = f"{c['median']:.2f}" + ("" if c["lo"] is None else f" [{c['lo']:.2f}-{c['hi']:.2f}]")
            ax.annotate(cell, (1.0, i), xycoords=("axes fraction", "data"), xytext=(6, 0), textcoords="offset points",
                        va="center", fontsize=8.5, color="0.2")
        for name in BASELINES:
            if name in rows:
                ax.axvline(methods[name][bw]["median"], color=_style(name, 0, ours)["color"], linestyle=":", lw=1,
                           zorder=1)
        ax.set_yticks(range(len(rows)), rows, fontsize=9)
        for tick, name in zip(ax.get_yticklabels(), rows):
            if name in BASELINES:
                tick.set_fontweight("bold")
        ax.set_ylim(-0.6, len(rows) - 0.4)
        values = [v for n in rows for v in (methods[n][bw]["median"], methods[n][bw]["lo"], methods[n][bw]["hi"])
                  if v is not None]
        log = bool(values) and max(values) / min(values) > 5
        if log:
            ax.set_xscale("log")
            _plain_log_axis(ax.xaxis)
        ax.annotate("ms [95 % interval]" if barred else "ms", (1.0, 1.0), xycoords="axes fraction", xytext=(6, 4),
                    textcoords="offset points", fontsize=8.5, color="0.2", va="bottom")
        ax.set_xlabel(f"{data['y']} at {bw}{', log' if log else ''}\n" + "\n".join(textwrap.wrap(link, 90))
                      + f"\n({note})", fontsize=9.5)
        ax.grid(alpha=0.3, axis="x", which="major")
        _headings(fig, ax, heading, sub)
        fig.tight_layout()  # it counts the value column right of the axes
    else:
        n = len(methods)
        width = min(0.4 / max(n - 1, 1), 0.04) if barred else 0.0  # bars side by side, not on top of each other
        legend_rows = math.ceil(n / 3)
        fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.6 + 0.2 * legend_rows))
        for i, (name, row) in enumerate(methods.items()):
            st = _style(name, index.get(name, 0), ours)
            shift = (i - (n - 1) / 2) * width
            xs = [j + shift for j, bw in enumerate(bws) if bw in row]
            cells = [row[bw] for bw in bws if bw in row]
            ys = [c["median"] for c in cells]
            lower = [0.0 if c["lo"] is None else c["median"] - c["lo"] for c in cells]
            upper = [0.0 if c["hi"] is None else c["hi"] - c["median"] for c in cells]
            ax.errorbar(xs, ys, yerr=[lower, upper] if any(lower + upper) else None, marker=st["marker"],
                        linestyle=st["linestyle"], color=st["color"], capsize=2.5, markersize=5, elinewidth=1,
                        linewidth=1.8 if name in BASELINES else 1.3, label=name)
        ax.set_xticks(range(len(bws)), bws)
        ax.set_yscale("log")
        ax.set_ylabel(data["y"] + ", log", fontsize=10)
        ax.set_xlabel("\n".join(textwrap.wrap(link, 90)), fontsize=9.5)
        ax.grid(alpha=0.3, which="both", axis="y")
        _headings(fig, ax, heading, sub)
        _plain_log_axis(ax.yaxis)
        legend = ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8.5, frameon=False,
                           title=note, title_fontsize=8.5)
        legend.get_title().set_color("0.25")
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


PHASE_ORDER = ("compute", "optimizer", "hooks", "encode", "exchange", "land")


def phase_data(results: dict, floor_of: Callable[[Optional[dict]], Optional[str]]) -> dict:
    """Per method with recorded phases (rank 0's first timing run, ms per step): each phase's ms, their sum, and
    the sum of its floor's phases (``floor_of(config)``: the floor method of its set-up, where it ran)."""
    rows = {}
    for name, m in results["methods"].items():
        phases = m.get("phases")
        if not phases:
            continue
        ms = {p: float(phases.get(p, {}).get("ms_per_step", 0.0)) for p in PHASE_ORDER}
        rows[name] = {"phases": ms, "total": sum(ms.values()), "floor": floor_of(m.get("config"))}
    for row in rows.values():
        row["floor_total"] = rows[row["floor"]]["total"] if row["floor"] in rows else None
    return {"unit": "ms per step, rank 0, first timing run", "methods": rows}


def draw_phases(data: dict, path: Path, heading: str, sub: str) -> None:
    """Each method's step as stacked phases (one bar), its floor's step as a mark on the same bar."""
    plt = _pyplot()
    names = list(data["methods"])
    fig, ax = plt.subplots(figsize=(9, 2.0 + 0.45 * len(names)))
    colours = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        left = 0.0
        for k, phase in enumerate(PHASE_ORDER):
            width = data["methods"][name]["phases"][phase]
            ax.barh(i, width, left=left, color=colours(k), label=phase if i == 0 else None)
            left += width
        floor = data["methods"][name]["floor_total"]
        if floor is not None and data["methods"][name]["floor"] != name:
            ax.plot([floor, floor], [i - 0.4, i + 0.4], color="black", linewidth=2,
                    label="its floor's step" if "its floor's step" not in ax.get_legend_handles_labels()[1] else None)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(data["unit"])
    ax.legend(fontsize=7, ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)
    _headings(fig, ax, f"{heading}: where a step's time goes", sub)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(results: dict, out: Path, *, metric: str, x_of: Callable[[dict], Optional[float]], x_label: str,
          heading: str, link: str, ours: Collection[str] = (),
          floor_of: Optional[Callable[[Optional[dict]], Optional[str]]] = None) -> List[str]:
    """Write ``accuracy_vs_bytes.json`` and ``time_vs_bandwidth.json`` (the plotted values, bar ends included)
    and the two pictures into ``out``; returns the pictures' file names.

    ``metric``: the quality column (``test_acc`` or ``val_loss``); ``x_of(method's row)``: the bytes it is
    compared on (None or 0: no point); ``x_label``: their axis label; ``heading``: the run's title; ``link``:
    what a link setting limits, for the time picture's axis; ``ours``: the methods that are commhooks'
    (circles; the others triangles)."""
    out = Path(out)
    sub = subtitle(results)
    quality = quality_data(results, metric, x_of, x_label)
    quality["labels"] = draw_quality(quality, out / "accuracy_vs_bytes.png", heading, sub, ours)
    (out / "accuracy_vs_bytes.json").write_text(json.dumps(quality, indent=2) + "\n")
    times = time_data(results)
    draw_time(times, out / "time_vs_bandwidth.png", heading, sub, link, ours)
    (out / "time_vs_bandwidth.json").write_text(json.dumps(times, indent=2) + "\n")
    drawn = ["accuracy_vs_bytes.png", "time_vs_bandwidth.png"]
    phases = phase_data(results, floor_of or (lambda config: None))
    if phases["methods"]:  # a run whose states timed their phases (commhooks/phases.py)
        draw_phases(phases, out / "phases.png", heading, sub)
        (out / "phases.json").write_text(json.dumps(phases, indent=2) + "\n")
        drawn.append("phases.png")
    return drawn
