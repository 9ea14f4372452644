"""Step-time ratios that resolve: paired repeats, a pace per repeat, and a bootstrap interval of the median.

Why (docs/pages/tools/measure.md): on this 2-core machine one method's repeats of compute-only spread 4.62-7.10 ms per
step, and its two ranks' medians differed by 27 %.  A ratio from one repeat, or from the slowest of ranks that
never wait for each other, can land anywhere from 0.85x to 1.39x for the same code.  So:

* **A repeat's pace.** Ranks that never wait for each other (a run that moved no byte through
  ``torch.distributed``: compute-only) are independent measurements of one step: their **mean** is the pace.
  Ranks that sync are held to the slowest one at every sync, so the **slowest** rank is the pace.
* **Paired ratios.** The bench runs every method once per repeat, interleaved (method A, B, C, then A, B, C
  again), so repeat ``k`` of a method and repeat ``k`` of its baseline shared the machine's state of that moment.
  Against compute-only the pairing is tighter: each method's run sits between two compute-only runs (F A F B F
  ..., :func:`bracketed_order`) and is divided by their geometric mean, which cancels a drift of the machine's
  speed (on 2026-12-06 it drifted by 60 % in 8 minutes with nothing else running; bracketing cut the intervals
  of a 25-repeat run from +-5-6 % to +-2-4 %).  Each repeat gives one ratio; the figure is the median of them.
* **An interval.** A 95 % percentile bootstrap of the median over the repeats (resampled with a fixed seed, so a
  rerun of the table prints the same interval), from :data:`MIN_REPEATS` repeats on: with 9 it spans about the
  2nd to the 8th ratio.  With fewer it would be about the range of the ratios, which covers the median far less
  often than 95 % (3 repeats: about 75 %), so a run of fewer repeats prints the range and the count, never an
  interval, and resolves nothing.
* **Resolved or not.** A ratio whose interval holds 1.0 (or a stated target) cannot be told from it: the table
  says "not resolved" instead of letting a median pass for a result.

Tuning: more repeats narrow the interval roughly as 1/sqrt(n); longer windows (more steps) cut each repeat's own
noise.  Pinning each rank to a core (where ranks <= cores) removes most of the spread between ranks.
"""

from __future__ import annotations

import random
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

MIN_REPEATS = 9  # the fewest repeats whose bootstrap interval of the median is published (fewer: the range)


def never_waits(ranks: Sequence[dict]) -> bool:
    """True for a run whose ranks moved no byte through torch.distributed (they never waited for each other)."""
    return all(r.get("payload_bytes_per_rank") == 0 for r in ranks)


def independent(moved_no_bytes: bool, ranks: int, cores: Optional[int]) -> bool:
    """Whether a run's ranks are each a measurement of one step, to be averaged: they moved no byte through
    torch.distributed (they never waited for each other: ``never_waits``) and each had a core of its own.  Where the ranks
    outnumber the cores (4 ranks on this machine's 2) they share them, and a rank that finishes first hands its
    core to the others: in one compute-only run of the GPT its ranks' step times were 103, 162, 162 and 203 ms
    where every rank ran at 210-230 ms in the runs around it.  The slowest rank, who ran beside the others to
    the end, is then the pace, as for ranks that sync (the whole work over the cores)."""
    return moved_no_bytes and (cores is None or ranks <= cores)


def pace(times_by_rank: Sequence[float], independent: bool) -> float:
    """One repeat's step time: the mean of ranks that never wait for each other, each on a core of its own,
    else the slowest rank's (``independent()`` says which)."""
    return statistics.fmean(times_by_rank) if independent else max(times_by_rank)


def paces(repeats_by_rank: Sequence[Sequence[float]], independent: bool) -> List[float]:
    """Per repeat, its pace: ``repeats_by_rank[r][k]`` is rank r's step time in repeat k."""
    return [pace([rank[k] for rank in repeats_by_rank], independent) for k in range(len(repeats_by_rank[0]))]


def median_interval(values: Sequence[float], level: float = 0.95, resamples: int = 4000,
                    seed: int = 0) -> Tuple[float, float, float]:
    """The median of ``values`` and a percentile-bootstrap interval of it at ``level``."""
    values = list(values)
    if len(values) == 1:
        return values[0], values[0], values[0]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    lo = medians[int(tail * (resamples - 1))]
    hi = medians[int(round((1.0 - tail) * (resamples - 1)))]
    return statistics.median(values), lo, hi


def paired_ratio(method: Sequence[float], baseline: Sequence[float], targets: Sequence[float] = (1.0,)) -> Dict:
    """Repeat k of ``method`` over repeat k of ``baseline``: every ratio, their median, its 95 % interval, and
    whether the interval clears 1.0 and every target (``resolved``)."""
    if len(method) != len(baseline):
        raise ValueError(f"paired repeats differ in number: {len(method)} and {len(baseline)}")
    ratios = [m / b for m, b in zip(method, baseline)]
    if len(ratios) < MIN_REPEATS:  # too few for an interval that covers: the range, and no verdict
        return {"median": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios), "ratios": ratios,
                "repeats": len(ratios), "interval": "range", "resolved": False}
    median, lo, hi = median_interval(ratios)
    resolved = not any(lo <= t <= hi for t in targets)
    return {"median": median, "lo": lo, "hi": hi, "ratios": ratios, "repeats": len(ratios),
            "interval": "95 % bootstrap", "resolved": resolved}


def bracketed(methods: Sequence[str], repeats: int, floor: str = "compute-only") -> bool:
    """Whether :func:`bracketed_order` puts each method between two floor runs: only with the floor and another
    method among them, and more than one repeat (one repeat resolves nothing: no extra floor runs)."""
    return floor in methods and any(m != floor for m in methods) and repeats > 1


def bracketed_order(methods: Sequence[str], repeats: int, floor: str = "compute-only") -> List[Tuple[str, int]]:
    """(method, its k-th run) in the order the runs go.  Every repeat runs each method once; where ``floor`` is
    among them, every other method's run sits between two runs of the floor (A B A: the floor runs once before
    each of them and once more at the very end), so a machine whose speed drifts during the repeats (measured
    2026-12-06: compute-only's pace went from 3.1 to 5.0 ms a step over 8 minutes, nothing else running) is
    compared with the floor at that moment, not a method's length of time earlier."""
    if not bracketed(methods, repeats, floor):
        return [(m, k) for k in range(repeats) for m in methods]
    order, f = [], 0
    for k in range(repeats):
        for m in (m for m in methods if m != floor):
            order += [(floor, f), (m, k)]
            f += 1
    return order + [(floor, f)]


def brackets(order: Sequence[Tuple[str, int]], method: str) -> List[Tuple[int, int]]:
    """For each run of ``method`` in :func:`bracketed_order`'s order, the floor's runs just before and after it."""
    runs = [p for p, (m, _) in enumerate(order) if m == method]
    return [(order[p - 1][1], order[p + 1][1]) for p in runs]


def bracketing(floor: Sequence[float], around: Sequence[Tuple[int, int]]) -> List[float]:
    """Per run of a method, the geometric mean of the floor's runs around it (``around``: :func:`brackets`)."""
    return [(floor[a] * floor[b]) ** 0.5 for a, b in around]


def bracketed_ratio(method: Sequence[float], floor: Sequence[float], around: Sequence[Tuple[int, int]],
                    targets: Sequence[float] = (1.0,)) -> Dict:
    """:func:`paired_ratio` of each run of ``method`` over the geometric mean of the floor's runs around it (a
    linear drift of the machine's speed cancels)."""
    return paired_ratio(method, bracketing(floor, around), targets)


def describe(ratio: Optional[Dict]) -> str:
    """A table cell: ``1.05x [1.02-1.08] resolved``, or ``not resolved`` where the interval holds 1.0 or a target;
    with fewer than :data:`MIN_REPEATS` repeats ``1.05x (range 1.01-1.09 of 3 repeats)``, no verdict."""
    if ratio is None:
        return "-"
    if ratio["repeats"] == 1:
        return f"{ratio['median']:.2f}x (1 repeat)"
    if ratio["repeats"] < MIN_REPEATS:
        ratios = ratio.get("ratios") or [ratio["lo"], ratio["hi"]]
        return f"{ratio['median']:.2f}x (range {min(ratios):.2f}-{max(ratios):.2f} of {ratio['repeats']} repeats)"
    cell = f"{ratio['median']:.2f}x [{ratio['lo']:.2f}-{ratio['hi']:.2f}]"
    return cell + (" resolved" if ratio["resolved"] else " not resolved")
