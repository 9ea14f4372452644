"""``commhooks curves``: the quadratic rule against a fixed period, as curves of quality against syncs.

    commhooks curves --variant fp32=configs/qsr_mnist1d.json --periods 2,4,8,16,32,64 \\
        --alphas 0.004,0.006,0.01,0.015,0.025 --h-base 2 --seeds 0,1,2,3,4,5,6,7,8,9 --out results/curves-mnist1d

QSR's paper (arXiv 2310.14423) claims that H = max(H_base, floor((alpha/lr)^2)) beats local SGD with a fixed
period.  Two methods that sync a different number of times cannot be compared by one row each: more syncs buy
quality.  So each family is swept into a curve, the rule over ``--alphas`` (``--h-base`` fixed) and the fixed
period over ``--periods`` (the same config with ``alpha = 0``, ``h_base = H``), every point with the same
warm-up, learning-rate schedule, data and seeds, and the rule is compared with the fixed period *at its own
number of syncs*.

How the comparison is made: per seed, the fixed period's quality is interpolated (linearly in log syncs, between
the two periods around the rule's count) and subtracted from the rule's quality on that seed; the mean of those
paired differences over the seeds, with its 95 % Student-t interval, gives the verdict: **above** (better:
higher accuracy, lower loss) or **below** where the interval excludes 0; **matches within ±m** where the whole
interval lies inside the equivalence margin ``--margin m``, stated before the run (recorded in ``plan.json`` when
the run starts: two one-sided tests at 2.5 % each); otherwise **not resolved**, with the smallest difference the
run could have resolved (the interval's half-width).  A difference that is not resolved is not an equality.
Pairing by seed removes what a seed does to both (its data order and initial weights), which is most of the
spread.

Whether the workload can tell at all: ``--reference ddp,compute-only`` runs DDP and no communication on the same
seeds, and the table gives no communication's paired gap to DDP with its interval.  A quality comparison is worth
making only where that gap is resolved and several times the differences in question (a workload where training
alone scores as well as DDP cannot show what a sync buys).  A rule point outside the periods' range of syncs is not compared (no extrapolation): sweep the
periods wide enough.

Each ``--variant label=config.json`` is a base config whose other keys (payload, outer step, hierarchy, what is
averaged) every point of both families keeps, so "plain averaging in fp32" and "the best payload and outer
step" are two variants of one run.  The points run through ``commhooks bench`` (quality runs on an unlimited
loopback link, one full run per seed, every method of a seed in one process group); ``--reference ddp`` adds
DDP as the dotted line it is measured against.  The time of a run is not a figure here.

Tuning advice: 8 seeds or more on MNIST-1D (one seed moves accuracy by up to 0.7 points); choose ``--periods``
and ``--alphas`` so the rule's counts of syncs fall inside the periods' (the rule syncs at most as often as
``--h-base``); at ``alpha ~ peak_lr * sqrt(h_base)`` the rule takes over at the peak learning rate.

Output in ``--out``: ``configs/`` (one file per point), ``runs/`` (the bench's run: ``results.json`` per seed and
method), ``curves.json`` (points, per-seed values, comparisons), ``curves.md`` and ``curves.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import bench
from .workloads import WORKLOADS

# two-sided 95 % quantiles of Student's t, by degrees of freedom (1-30); above 30, 1.96 is within 4 %
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t_interval(values: Sequence[float]) -> Tuple[float, Optional[float], Optional[float]]:
    """(mean, low, high): the mean and its 95 % Student-t interval (None, None with fewer than 2 values)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None, None
    half = (T975[len(values) - 2] if len(values) <= 31 else 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return m, m - half, m + half


def seed_summary(method: dict, seeds: Sequence[str]) -> dict:
    """A bench method's quality on ``seeds``: the values in order, their mean and its 95 % t interval."""
    values = [method["quality_by_seed"][s] for s in seeds]
    mean, lo, hi = t_interval(values)
    return {"by_seed": values, "mean": mean, "lo": lo, "hi": hi}


def point_configs(base: dict, periods: Sequence[int], alphas: Sequence[float],
                  h_bases: Sequence[int]) -> Dict[str, dict]:
    """One config per point: ``fixed-h<H>`` (``alpha 0, h_base H``) and ``rule-a<alpha>`` (``h_base`` and
    ``alpha``; ``rule-h<h_base>-a<alpha>`` with several ``h_bases``), every other key of ``base`` kept (payload,
    outer step, what is averaged; the rule's warm-up and power only where they act)."""
    if base.get("type") != "qsr":
        raise ValueError(f"a variant's config must have \"type\": \"qsr\" (the rule and the fixed period are both "
                         f"QSR's), got type {base.get('type')!r}")
    fixed = {k: v for k, v in base.items() if k != "power" and (k != "warmup_steps" or base.get("init_h") is not None)}
    points = {f"fixed-h{h}": {**fixed, "alpha": 0.0, "h_base": int(h)} for h in periods}  # (the rule's own keys
    # left out: with alpha 0 they would change nothing, and a config refuses a key that changes nothing)
    for hb in h_bases:
        tag = f"rule-h{hb}-" if len(h_bases) > 1 else "rule-"
        points.update({f"{tag}a{a:g}": {**base, "alpha": float(a), "h_base": int(hb)} for a in alphas})
    return points


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> Optional[float]:
    """``ys`` at ``x``, linear in log x between the two points around it (``xs`` ascending); None outside."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            if x1 == x0:
                return (y0 + y1) / 2
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return ys[-1] if x == xs[-1] else None


def verdict(lo: Optional[float], hi: Optional[float], margin: Optional[float], metric: str = "val_loss") -> str:
    """The verdict on a paired difference's 95 % interval [lo, hi] (+ = the rule better) against the equivalence
    ``margin`` (None: none was set before the run, so nothing is called equal); sizes in the table's unit (a loss
    as is, an accuracy in points)."""
    if lo is None or hi is None:
        return "not resolved (one seed)"
    if lo > 0:
        return "above"
    if hi < 0:
        return "below"
    if margin is not None and -margin <= lo and hi <= margin:
        return f"matches within ±{fmt_size(margin, metric)}"
    return f"not resolved (could resolve ±{fmt_size((hi - lo) / 2, metric)})"


def fmt_size(x: float, metric: str) -> str:
    """A size of difference: a loss to 4 places, an accuracy in points to 2."""
    return f"{x:.4f}" if metric == "val_loss" else f"{100 * x:.2f} points"


def analyse(results: dict, variants: Dict[str, dict], reference, margin: Optional[float] = None) -> dict:
    """Points, and each rule point against the fixed period at its syncs (see the module docstring).
    ``reference``: bench methods run on the same seeds (a name, or a list whose first is the dotted line);
    with ``ddp`` and ``compute-only`` among them, no communication's paired gap to DDP."""
    metric = WORKLOADS[results["setup"]["model"]].metric
    sign = -1.0 if metric == "val_loss" else 1.0  # a difference > 0 is the rule doing better
    seeds = [str(s) for s in results["setup"]["seeds"]]
    references = [reference] if isinstance(reference, str) else list(reference or [])
    out: dict = {"metric": metric, "better": "lower" if sign < 0 else "higher", "seeds": seeds, "variants": {},
                 "margin": margin}
    for variant, point_names in variants.items():
        points = {}
        for family in ("fixed", "rule"):
            for name in point_names[family]:
                m = results["methods"][name]
                points[name] = {"family": family, "param": point_names["param"][name], "syncs": m["syncs"],
                                "bytes_per_rank": m["payload_bytes_per_rank"], **seed_summary(m, seeds)}
        fixed = sorted((p for p in points.values() if p["family"] == "fixed"), key=lambda p: p["syncs"])
        fixed_syncs = [f["syncs"] for f in fixed]
        compared = {}
        for name in point_names["rule"]:
            p = points[name]
            diffs = []
            for i in range(len(seeds)):
                y = interpolate(fixed_syncs, [f["by_seed"][i] for f in fixed], p["syncs"])
                if y is None:
                    break
                diffs.append(sign * (p["by_seed"][i] - y))
            if len(diffs) != len(seeds):
                compared[name] = {"syncs": p["syncs"], "verdict": "outside the periods' range"}
                continue
            mean, lo, hi = t_interval(diffs)
            compared[name] = {"syncs": p["syncs"], "diffs": diffs, "mean": mean, "lo": lo, "hi": hi,
                              "verdict": verdict(lo, hi, margin, metric)}
        out["variants"][variant] = {"points": points, "rule_vs_fixed": compared}
    summaries = {name: {"name": name, **seed_summary(results["methods"][name], seeds),
                        "syncs": results["methods"][name].get("syncs"),
                        "bytes_per_rank": results["methods"][name]["payload_bytes_per_rank"]} for name in references}
    if references:
        out["reference"] = summaries[references[0]]
        out["references"] = summaries
    if "ddp" in summaries and "compute-only" in summaries:  # how much a sync can buy here: none's loss to DDP
        gap = [sign * (d - c) for d, c in zip(summaries["ddp"]["by_seed"], summaries["compute-only"]["by_seed"])]
        mean, lo, hi = t_interval(gap)
        out["no_communication_gap"] = {"by_seed": gap, "mean": mean, "lo": lo, "hi": hi,
                                       "resolved": lo is not None and lo > 0}
    return out


def pool(runs: Sequence[dict], margin: Optional[float] = None) -> dict:
    """Several recorded sweeps (their ``curves.json``) of the same points pooled: for each rule point every run
    compared, the seeds' paired differences put together (the seeds must differ) and judged again, as one run of
    all their seeds would be.  The runs must share the workload, its length and the point's config (its syncs)."""
    first = runs[0]
    for run in runs[1:]:
        same = (run["setup"]["model"], run["setup"]["steps"], run["metric"]) == (
            first["setup"]["model"], first["setup"]["steps"], first["metric"])
        if not same:
            raise ValueError("curves --pool: the runs differ in workload, steps or metric")
    seeds = [s for run in runs for s in run["seeds"]]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"curves --pool: a seed appears in two runs ({sorted(seeds)}): pool disjoint seeds")
    out = {"metric": first["metric"], "better": first["better"], "seeds": seeds, "margin": margin,
           "pooled": [run.get("source", "") for run in runs], "variants": {}}
    for variant in first["variants"]:
        compared = {}
        for name in first["variants"][variant]["rule_vs_fixed"]:
            parts = [run["variants"].get(variant, {}).get("rule_vs_fixed", {}).get(name) for run in runs]
            if any(p is None or "diffs" not in p for p in parts):
                continue  # a point not every run compared
            if len({p["syncs"] for p in parts}) != 1:
                raise ValueError(f"curves --pool: {name} synced {[p['syncs'] for p in parts]} times in the runs")
            diffs = [d for p in parts for d in p["diffs"]]
            mean, lo, hi = t_interval(diffs)
            compared[name] = {"syncs": parts[0]["syncs"], "diffs": diffs, "mean": mean, "lo": lo, "hi": hi,
                              "verdict": verdict(lo, hi, margin, first["metric"]),
                              "rule_mean": statistics.fmean(v for run, p in zip(runs, parts) for v in
                                                            run["variants"][variant]["points"][name]["by_seed"])}
        if compared:
            out["variants"][variant] = {"rule_vs_fixed": compared}
    return out


def pooled_rows(curves: dict, variant: str) -> List[str]:
    """A pooled run's rule points as markdown rows: name, syncs, the seeds, the rule's quality (mean of the pooled
    seeds), the paired difference from the periods there (+ = the rule better) with its 95 % t interval, the
    verdict.  The docs quote these rows (docs/claims.toml ``[[table]]``)."""
    metric, n = curves["metric"], len(curves["seeds"])
    return [f"| {name} | {c['syncs']} | {n} | {fmt(c['rule_mean'], metric)} | {fmt_diff(c['mean'], metric)} "
            f"[{fmt_diff(c['lo'], metric)} to {fmt_diff(c['hi'], metric)}] | {c['verdict']} |"
            for name, c in curves["variants"][variant]["rule_vs_fixed"].items()]


def fmt(x: Optional[float], metric: str) -> str:
    """A quality figure as the tables print it: a loss to 4 places, an accuracy in % to 2."""
    return "-" if x is None else (f"{x:.4f}" if metric == "val_loss" else f"{100 * x:.2f}")


def fmt_diff(x: float, metric: str) -> str:
    """A signed difference of quality: a loss to 4 places, an accuracy in points to 2."""
    return f"{x:+.4f}" if metric == "val_loss" else f"{100 * x:+.2f}"


def point_rows(curves: dict, variant: str) -> List[str]:
    """A variant's points as markdown rows (fixed periods, then the rule, most syncs first): name, syncs, MB sent
    per rank, quality mean [95 % t interval].  The docs quote these rows (docs/claims.toml ``[[table]]``)."""
    metric = curves["metric"]
    points = curves["variants"][variant]["points"]
    order = sorted(points.items(), key=lambda kv: (kv[1]["family"], kv[1]["param"]["h_base"]
                                                  if kv[1]["family"] == "rule" else 0, -kv[1]["syncs"]))
    return [f"| {name} | {p['syncs']} | {p['bytes_per_rank'] / 1e6:.2f} | {fmt(p['mean'], metric)} "
            f"[{fmt(p['lo'], metric)}-{fmt(p['hi'], metric)}] |" for name, p in order]


def verdict_rows(curves: dict, variant: str) -> List[str]:
    """Each rule point against the fixed period at its syncs, as markdown rows: name, syncs, the rule's quality
    and the fixed period's interpolated there (means of seeds), the paired difference (+ = the rule better;
    accuracy in points, loss as is) with its 95 % t interval, the verdict."""
    metric = curves["metric"]
    sign = -1.0 if metric == "val_loss" else 1.0  # as analyse(): a difference > 0 is the rule doing better
    rows = []
    for name, c in curves["variants"][variant]["rule_vs_fixed"].items():
        if "mean" not in c:
            rows.append(f"| {name} | {c['syncs']} | - | - | - | {c['verdict']} |")
            continue
        rule = curves["variants"][variant]["points"][name]["mean"]
        rows.append(f"| {name} | {c['syncs']} | {fmt(rule, metric)} | {fmt(rule - sign * c['mean'], metric)} | "
                    f"{fmt_diff(c['mean'], metric)} [{fmt_diff(c['lo'], metric)} to {fmt_diff(c['hi'], metric)}] "
                    f"| {c['verdict']} |")
    return rows


def table(curves: dict, setup: dict) -> str:
    """Markdown: per variant the points (mean and 95 % interval over seeds) and the rule against the period."""
    metric = curves["metric"]
    unit = "val loss" if metric == "val_loss" else "test acc (%)"
    diff = "loss" if metric == "val_loss" else "points"
    n = len(curves["seeds"])
    lines = [f"# The rule against a fixed period: {setup['model']}, {setup['ranks']} ranks, {setup['steps']} steps, "
             f"{n} seeds ({setup['date']}, commit {setup.get('commit', '?')[:7]}"
             f"{' with uncommitted changes' if setup.get('dirty') else ''})", ""]
    for r in curves.get("references", {"": curves["reference"]} if "reference" in curves else {}).values():
        lines += [f"Reference {r['name']}: {unit} {fmt(r['mean'], metric)} [{fmt(r['lo'], metric)}-"
                  f"{fmt(r['hi'], metric)}] (mean of {n} seeds, 95 % t interval).", ""]
    gap = curves.get("no_communication_gap")
    if gap is not None:
        lines += [f"Whether this workload can tell: no communication against DDP, paired by seed, DDP better by "
                  f"{fmt_diff(gap['mean'], metric)} [{fmt_diff(gap['lo'], metric)} to {fmt_diff(gap['hi'], metric)}]"
                  f" ({'resolved' if gap['resolved'] else 'not resolved'}; a difference claimed here should be at "
                  f"most a fifth of it, {fmt_diff(gap['mean'] / 5, metric)}).", ""]
    margin = curves.get("margin")
    lines += [f"Equivalence margin, set before the run: ±{fmt_size(margin, metric)} (\"matches\" needs the whole "
              "95 % interval inside it)." if margin is not None else "No equivalence margin was set before this run: "
              "nothing is called equal.", ""]
    for variant in curves["variants"]:
        lines += [f"## {variant}", "", f"| point | syncs | MB sent per rank | {unit}, mean [95 % interval] |",
                  "|---|---|---|---|", *point_rows(curves, variant), "",
                  f"| rule point | syncs | rule, {unit} | fixed period there | rule minus fixed period, {diff} (+ = "
                  "rule better), mean [95 % interval] | verdict |", "|---|---|---|---|---|---|",
                  *verdict_rows(curves, variant),
                  ""]
    return "\n".join(lines)


def draw(curves: dict, setup: dict, path: Path) -> None:
    """One panel per variant: quality against syncs (log), each family a line with 95 % t bars, DDP dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = curves["metric"]
    scale = 1.0 if metric == "val_loss" else 100.0
    variants = list(curves["variants"])
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    # each panel its own scale: one variant's spread of 50 points would flatten another's of 1
    fig, axes = plt.subplots(1, len(variants), figsize=(5.2 * len(variants), 4.2), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        pts = curves["variants"][variant]["points"]
        lines = [("fixed", None, "#1f77b4", "o")] + [
            ("rule", hb, colour, "s") for hb, colour in zip(sorted({p["param"]["h_base"] for p in pts.values()
                                                                  if p["family"] == "rule"}),
                                                          ("#d62728", "#ff7f0e", "#2ca02c", "#9467bd"))]
        for family, hb, colour, marker in lines:
            ps = sorted((p for p in pts.values() if p["family"] == family and hb in (None, p["param"]["h_base"])),
                        key=lambda p: p["syncs"])
            xs = [p["syncs"] for p in ps]
            ys = [scale * p["mean"] for p in ps]
            err = None if ps[0]["lo"] is None else [[scale * (p["mean"] - p["lo"]) for p in ps],
                                                    [scale * (p["hi"] - p["mean"]) for p in ps]]
            label = ("fixed period H (labels)" if family == "fixed" else
                     f"rule, h_base {ps[0]['param']['h_base']} (labels: alpha)")
            ax.errorbar(xs, ys, yerr=err, color=colour, marker=marker, capsize=3, label=label)
            for p, x, y in zip(ps, xs, ys):
                text = f"{p['param']['h_base']}" if family == "fixed" else f"{p['param']['alpha']:g}"
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, -10 if family == "rule" else 5),
                            fontsize=7, color=colour)
        for r, style in zip(curves.get("references", {"": curves.get("reference")}).values(), (":", "--")):
            if r is not None:
                label = f"{r['name']} (every step)" if r["name"] != "compute-only" else "no communication"
                ax.axhline(scale * r["mean"], color="black", linestyle=style, label=label)
        ax.set_xscale("log")  # plain numbers at 1-2-5 steps (the default's 2x10^1 labels run into each other)
        syncs = [p["syncs"] for p in pts.values()]
        ticks = [t * 10 ** e for e in range(0, 7) for t in (1, 2, 5) if min(syncs) / 2 <= t * 10 ** e <= max(syncs) * 2]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("syncs in the run")
        ax.set_title(variant, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_ylabel(("validation loss" if metric == "val_loss" else "test accuracy (%)")
                      + f", mean of {len(curves['seeds'])} seeds, 95 % t bars", fontsize=8)
    fig.suptitle(f"The rule against a fixed period: {setup['model']}, {setup['ranks']} ranks, {setup['steps']} "
                 f"steps ({setup['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def parse_seeds(text: str) -> List[int]:
    """``0,1,2`` or ``0-9``."""
    if "-" in text and "," not in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(s) for s in text.split(",") if s.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="commhooks curves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", required=False, default=[], metavar="LABEL=CONFIG.json",
                   help="a base QSR config; every point keeps its other keys (repeat for several variants)")
    p.add_argument("--periods", default="2,4,8,16,32", help="the fixed period's H values")
    p.add_argument("--alphas", default="0.004,0.006,0.01,0.015", help="the rule's alpha values")
    p.add_argument("--h-base", default="2",
                   help="the rule's h_base (the fewest steps between syncs); a comma list sweeps alpha at each")
    p.add_argument("--reference", default="ddp", help="bench methods run on the same seeds, a comma list; the first "
                   "is drawn as the dotted line; ddp,compute-only also gives no communication's gap to DDP ('none')")
    p.add_argument("--margin", type=float, default=None, help="the equivalence margin (accuracy as a fraction, "
                   "loss as is), set before the run: a rule point 'matches' the periods where the whole 95 %% "
                   "interval of its paired difference lies within ±margin")
    p.add_argument("--model", choices=tuple(WORKLOADS), default="cnn")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", default="0-7", help="comma list or a range a-b")
    p.add_argument("--out", required=False)
    p.add_argument("--replot", metavar="DIR", help="only redo curves.json/md/png from DIR's recorded runs")
    p.add_argument("--pool", nargs="+", metavar="DIR", help="pool recorded sweeps of the same points (disjoint seeds) "
                   "into --out: each rule point's paired differences over all their seeds, judged again")
    args = p.parse_args(argv)
    if args.replot:
        return args
    if args.pool:
        if not args.out:
            p.error("--pool needs --out")
        return args
    if not args.out or not args.variant:
        p.error("--out and at least one --variant LABEL=CONFIG.json are needed (or --replot DIR)")
    try:
        args.periods = [int(x) for x in args.periods.split(",") if x.strip()]
        args.alphas = [float(x) for x in args.alphas.split(",") if x.strip()]
        args.seeds = parse_seeds(args.seeds)
        args.h_base = [int(x) for x in args.h_base.split(",") if x.strip()]
    except ValueError as exc:
        p.error(f"--periods, --alphas, --h-base and --seeds are comma lists of numbers: {exc}")
    if len(args.periods) < 2 or min(args.periods) < 1 or not args.h_base or min(args.h_base) < 1 or not args.alphas \
            or min(args.alphas) <= 0:
        p.error("--periods needs at least two H >= 1, --alphas at least one alpha > 0, --h-base >= 1")
    variants = {}
    for entry in args.variant:
        label, sep, path = entry.partition("=")
        if not sep or not Path(path).is_file():
            p.error(f"--variant {entry!r}: expected LABEL=path/to/config.json with an existing file")
        variants[label] = json.loads(Path(path).read_text())
    args.variant = variants
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pool:
        runs = []
        for d in args.pool:
            run = json.loads((Path(d) / "curves.json").read_text())
            run["source"] = str(d)
            runs.append(run)
        try:
            pooled = pool(runs, args.margin)
        except ValueError as exc:
            raise SystemExit(str(exc))
        pooled["setup"] = runs[0]["setup"]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "curves.json").write_text(json.dumps(pooled, indent=2) + "\n")
        unit = "val loss" if pooled["metric"] == "val_loss" else "test acc (%)"
        md = [f"# Pooled: {', '.join(args.pool)} ({len(pooled['seeds'])} seeds)", ""]
        for variant in pooled["variants"]:
            md += [f"## {variant}", "", f"| rule point | syncs | seeds | rule, {unit} | rule minus fixed period "
                   "(+ = rule better), mean [95 % interval] | verdict |", "|---|---|---|---|---|---|",
                   *pooled_rows(pooled, variant), ""]
        (out / "curves.md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
        return 0
    out = Path(args.replot or args.out)
    if args.replot:
        plan = json.loads((out / "plan.json").read_text())
    else:
        (out / "configs").mkdir(parents=True, exist_ok=True)
        references = [] if args.reference == "none" else [r for r in args.reference.split(",") if r.strip()]
        plan = {"variants": {}, "reference": references, "margin": args.margin}
        methods = list(references)
        for variant, base in args.variant.items():
            try:
                points = point_configs(base, args.periods, args.alphas, args.h_base)
            except ValueError as exc:
                raise SystemExit(f"commhooks curves: --variant {variant}: {exc}")
            names = {"fixed": [], "rule": [], "param": {}}
            for point, config in points.items():
                label = f"{variant}.{point}"
                path = out / "configs" / f"{label}.json"
                path.write_text(json.dumps(config, indent=2) + "\n")
                methods.append(f"{label}={path}")
                names[point.split("-")[0]].append(label)
                names["param"][label] = {"h_base": config["h_base"], "alpha": config["alpha"]}
            plan["variants"][variant] = names
        (out / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
        bench_argv = ["--model", args.model, "--ranks", str(args.ranks), "--seeds", ",".join(map(str, args.seeds)),
                      "--bandwidths", "unlimited", "--repeats", "1", "--netns", "off", "--methods", ",".join(methods),
                      "--out", str(out / "runs")]
        bench_argv += ["--nodes", str(args.nodes)] if args.nodes else []
        bench_argv += ["--steps", str(args.steps)] if args.steps else []
        code = bench.main(bench_argv)
        if code:
            return code
    results = json.loads((out / "runs" / "results.json").read_text())
    curves = analyse(results, plan["variants"], plan["reference"], plan.get("margin"))
    curves["setup"] = results["setup"]
    (out / "curves.json").write_text(json.dumps(curves, indent=2) + "\n")
    md = table(curves, results["setup"])
    (out / "curves.md").write_text(md + "\n")
    draw(curves, results["setup"], out / "curves.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
