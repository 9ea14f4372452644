"""Markdown rows that the docs quote from recorded runs, written from the run's own files.

A table the docs copy by hand goes stale the day its run is redone; one the run's files write cannot.  Each
function here takes a parsed results file and returns table rows; ``docs/claims.toml`` names it in a
``[[table]]`` entry, and ``docs/claims.py --check`` fails when a row in the docs differs from what the function
writes today (so every figure on those rows is sourced).  The functions only format: what is measured and how
is the business of the tool that wrote the file (``commhooks bench``, ``commhooks curves``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple


def _quality(x: Optional[float], metric: str) -> str:
    return "-" if x is None else f"{x:.4f}" if metric == "val_loss" else f"{x:.3f}"


def _sent_cells(sent: Optional[float], base_sent: Optional[float], is_baseline: bool, mb_digits: int = 1,
                share_digits: int = 1) -> List[str]:
    """Two cells: the MB a rank sent and that as a share of the baseline's ("-" where unknown, and the baseline's
    own share)."""
    return ["-" if sent is None else f"{sent / 1e6:.{mb_digits}f}",
            "-" if is_baseline or not base_sent or sent is None else f"{100 * sent / base_sent:.{share_digits}f} %"]


def quality_cells(results: dict, name: str, baseline: str = "ddp") -> List[str]:
    """A ``commhooks bench`` method's cells: quality on the held-out seeds (or every seed's mean) and its
    spread over them (min-max), the search seeds' mean in brackets where the run names search seeds, syncs, MB
    sent per rank and that as a share of ``baseline``'s bytes."""
    m = results["methods"][name]
    metric = "val_loss" if m.get("val_loss") is not None else "test_acc"
    seeds = [str(s) for s in results["setup"]["seeds"]]
    search = [str(s) for s in results["setup"].get("search_seeds") or []]
    values = [m["quality_by_seed"][s] for s in seeds if s not in search]
    cells = [_quality(sum(values) / len(values), metric),
             f"{_quality(min(values), metric)}-{_quality(max(values), metric)}"]
    if search:
        cells.append(f"({_quality(m['quality_search_mean'], metric)})")
    return cells + [str(m["syncs"]) if m.get("syncs") is not None else "-",
                    *_sent_cells(m["payload_bytes_per_rank"], results["methods"][baseline]["payload_bytes_per_rank"],
                                 name == baseline, mb_digits=2)]


def bench_quality(results: dict, methods: Sequence[str], baseline: str = "ddp") -> List[str]:
    """One row per method of a ``commhooks bench`` run: its name, then :func:`quality_cells`."""
    return ["| " + " | ".join([name, *quality_cells(results, name, baseline)]) + " |" for name in methods]


def ab_layers(summary: dict) -> List[str]:
    """The AB report of one rank's ``train --json-out`` summary, as rows: each weight's name, shape, the rank
    its factors had at the end of the run (``dense`` where it stayed full-rank) and its parameter compression
    ``m*n / ((m+n)*k)``; then the whole model's parameters dense and factored and their ratio."""
    report = summary["report"]
    rows = [f"| `{layer['name']}` | {' x '.join(map(str, layer['shape']))} | "
            f"{'dense' if layer['rank'] is None else layer['rank']} | {layer['compression']:.2f}:1 |"
            for layer in report["layers"]]
    rows.append(f"| the whole model | {report['params_dense']} -> {report['params_factored']} parameters | | "
                f"{report['compression']:.2f}:1 |")
    return rows


def ab_trade(results: dict, run_dir: str, methods: Sequence[str], baseline: str = "ddp",
             node_links: bool = False) -> List[str]:
    """AB's trade, one row per method of a ``commhooks bench`` run: its ``rank_cutoff``, the parameter
    compression it reached at the end of each held-out seed's run (``run_dir``'s rank-0 summaries: the seeds the
    quality comes from; their mean and range), then the :func:`quality_cells` (quality on held-out seeds with their
    range, search seeds, syncs, MB, share).
    ``node_links``: for a run on several nodes, two more cells, the MB a rank sent across the node links and
    that as a share of ``baseline``'s: an AB group inside a node averages its factor's gradient there, so
    what crosses the nodes is AB's warm-up, full-rank steps and syncs."""
    from .bench import compared_bytes

    seeds = results["setup"]["seeds"]
    search = set(results["setup"].get("search_seeds") or [])
    held = [x for x in seeds if x not in search] or seeds
    base_sent = compared_bytes(results, results["methods"][baseline])

    def summary(name: str, seed: int) -> dict:  # the first seed's full run may be the unlimited timing run
        where = Path(run_dir) / f"seed{seed}"
        if seed == seeds[0] and not where.is_dir():
            where = Path(run_dir) / "time-unlimited"
        return json.loads((where / f"{name}.rank0.json").read_text())

    rows = []
    for name in methods:
        ab = ["-", "-"]
        if name != baseline:
            ratios = [summary(name, x)["report"]["compression"] for x in held]
            ab = [str(summary(name, held[0])["config"].get("rank_cutoff")),
                  f"{sum(ratios) / len(ratios):.2f}:1 ({min(ratios):.2f}-{max(ratios):.2f})"]
        cells = [name, *ab, *quality_cells(results, name, baseline)]
        if node_links:
            cells += _sent_cells(compared_bytes(results, results["methods"][name]), base_sent, name == baseline)
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _held_out(results: dict) -> Tuple[List[str], set]:
    """A protocol run's held-out seeds (every seed where it names no search seeds) and its search seeds."""
    seeds = [str(s) for s in results["setup"]["seeds"]]
    search = {str(s) for s in results["setup"].get("search_seeds") or []}
    return [s for s in seeds if s not in search] or seeds, search


def _vs_baseline(m: dict, base: dict, held: Sequence[str]) -> str:
    """``m``'s quality against ``base``'s seed by seed on ``held``: the mean and the seeds' range, a loss
    relative in %, an accuracy in points (``+1.2 % (-0.8 to +2.5)``)."""
    if m.get("val_loss") is not None:
        diff, unit = [100 * (m["quality_by_seed"][s] / base["quality_by_seed"][s] - 1) for s in held], " %"
    else:
        diff, unit = [100 * (m["quality_by_seed"][s] - base["quality_by_seed"][s]) for s in held], " points"
    return f"{sum(diff) / len(diff):+.1f}{unit} ({min(diff):+.1f} to {max(diff):+.1f})"


def choice_rows(results: dict, choices: Sequence[Dict[str, str]], runs_dir: Optional[str] = None,
                baseline: str = "ddp", floor: str = "compute-only") -> List[str]:
    """The choosing guide's decision table from a ``commhooks bench`` run under the protocol, one row per choice
    (``situation``; ``start``: what to configure; ``method``: its name in the run): the memory commhooks keeps
    beside the model and its optimizer, as a multiple of the weights (``report()["memory_vs_weights"]`` of rank 0
    on the first held-out seed, read from ``runs_dir``; "-" for a method commhooks does not run), the quality
    against ``baseline`` seed by seed on the held-out seeds (mean and range), the share of ``baseline``'s bytes
    across the node links, and the step time over ``floor``'s at the run's slowest link
    (:func:`~.timing.describe`: an interval only from enough repeats, else the range)."""
    from . import timing
    from .bench import compared_bytes

    held, _ = _held_out(results)
    base = results["methods"][baseline]
    base_sent = compared_bytes(results, base)
    bw = results["setup"]["bandwidths"][-1]
    rows = []
    for choice in choices:
        name = choice["method"]
        m = results["methods"][name]
        memory = "-"
        rank0 = Path(runs_dir) / f"seed{held[0]}" / f"{name}.rank0.json" if runs_dir else None
        if rank0 is not None and rank0.is_file():
            kept = (json.loads(rank0.read_text()).get("report") or {}).get("memory_vs_weights")
            memory = "-" if kept is None else f"{kept:.2f}x the weights"
        quality = "-" if name == baseline else (
            ("loss " if m.get("val_loss") is not None else "accuracy ") + _vs_baseline(m, base, held))
        share = _sent_cells(compared_bytes(results, m), base_sent, name == baseline, share_digits=2)[1]
        paired = m.get("ratios", {}).get(bw) or {}
        time = "-" if name == floor else timing.describe(paired.get("vs compute-only"))
        rows.append("| " + " | ".join([choice["situation"], choice["start"], memory, quality, share, time]) + " |")
    return rows


def headline_rows(results: dict, methods: Sequence[str], labels: Optional[Dict[str, str]] = None,
                  baseline: str = "ddp", floor: str = "compute-only", window_columns: bool = False,
                  floor_columns: bool = False) -> List[str]:
    """A ``commhooks bench`` run under the protocol (docs/pages/tools/measure.md), one row per method: its label, quality
    on the held-out seeds, the search seeds' in brackets, the held-out seeds' mean difference from ``baseline``
    seed by seed (a loss in %, an accuracy in points; ``(lo to hi)``: the seeds' range), syncs, the MB a rank sent across the node links (all it
    sent on one node), that as a share of ``baseline``'s, the step time over ``floor``'s and ``baseline``'s step
    time over this, each ``median [95 % interval]`` from the run's interleaved repeats.  ``window_columns``: after
    the whole run's syncs and bytes, the timed steps and the syncs and MB (across the node links) in those same
    steps, which the times cover (a run recorded before windows were kept has none).  ``floor_columns``: after the
    step time over ``floor``'s, the step time over the method's own floor (``bench.floor_of``: its hooks with no
    sync, or with replica groups their in-node mean too), repeat by repeat, where the run has it."""
    from . import timing
    from .bench import compared_bytes

    labels = labels or {}
    held, search = _held_out(results)
    base = results["methods"][baseline]
    base_sent = compared_bytes(results, base)
    bw = results["setup"]["bandwidths"][-1]
    rows = []
    for name in methods:
        m = results["methods"][name]
        metric = "val_loss" if m.get("val_loss") is not None else "test_acc"
        quality = [m["quality_by_seed"][s] for s in held]
        cells = [labels.get(name, name), _quality(sum(quality) / len(quality), metric),
                 f"({_quality(m['quality_search_mean'], metric)})" if search else "-"]
        cells.append("-" if name == baseline else _vs_baseline(m, base, held))
        cells += [str(m["syncs"]) if m.get("syncs") is not None else "-",
                  *_sent_cells(compared_bytes(results, m), base_sent, name == baseline, share_digits=2)]
        if window_columns:  # the steps the times cover, and what the method sent in those same steps
            window = m.get("timed_window")
            sent = m.get("window_cross_node_payload_bytes_per_rank")
            if sent is None:
                sent = m.get("window_payload_bytes_per_rank")
            cells += ["-" if window is None else f"{window[0]}-{window[1]}",
                      "-" if m.get("window_syncs") is None else str(m["window_syncs"]),
                      "-" if sent is None else f"{sent / 1e6:.1f}"]
        paired = m.get("ratios", {}).get(bw) or {}
        cells.append("-" if name == floor else timing.describe(paired.get("vs compute-only")))
        if floor_columns:
            own = paired.get("vs its floor")
            cells.append("-" if own is None else f"{timing.describe(own)} ({own['floor']})")
        cells.append("-" if name == baseline else timing.describe(paired.get("ddp over this")))
        rows.append("| " + " | ".join(cells) + " |")
    return rows
