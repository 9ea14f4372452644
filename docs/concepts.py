"""Draw the docs' concept pictures from commhooks' own code: ``python docs/concepts.py [OUT_DIR]``.

Each picture is computed, not sketched: the traffic and the sync points come from the algorithms' traffic
declarations (the same code the planner uses and the suite holds to the byte meter), the periods from QSR's rule
function, the model's shapes from the benchmark's byte-level GPT.  ``make docs`` redraws them; the suite runs this
script and checks what each picture shows (``tests/test_docs.py``).

* ``traffic.png``: what one rank sends over a run, DDP against a sync every 4 steps in int2 and the quadratic rule;
* ``period.png``: the rule's period H against the step, with the learning rate it follows;
* ``groups.png``: replica groups and a hierarchical sync, for 2 nodes of 2 ranks;
* ``overlap.png``: a blocking sync against one that lands a step later (``overlap_steps`` 1).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hooks"))

from commhooks import registry  # noqa: E402
from commhooks.algorithms.qsr.state import qsr_period  # noqa: E402
from commhooks.algorithms.traffic import Setting  # noqa: E402
from commhooks.config import load_config  # noqa: E402

OUT = REPO / "docs" / "pages" / "pictures"
STEPS, WARMUP, PEAK_LR = 1000, 50, 0.002  # the GPT workload's schedule (commhooks bench --model gpt)


def gpt_shapes():
    """The byte-level GPT's trainable parameters (name, shape), as the benchmark builds it."""
    from commhooks.tools.models import build_model

    return [(n, tuple(p.shape)) for n, p in build_model("gpt").named_parameters() if p.requires_grad]


def lr(step: int) -> float:
    """The benchmark's schedule: linear warm-up to the peak, cosine to zero at the last step."""
    if step < WARMUP:
        return PEAK_LR * (step + 1) / WARMUP
    return PEAK_LR * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - WARMUP) / (STEPS - WARMUP))))


def config(name: str, **over):
    data = json.loads((REPO / "configs" / f"{name}.json").read_text())
    data.update(total_steps=STEPS, **over)
    return load_config(data)


def traffic(shapes) -> dict:
    """Cumulative MB one rank sends, step by step: DDP (every step's gradients, 4 bytes a parameter, as its
    allreduce hands them over), and two configs as declared for 2 ranks on 2 nodes."""
    setting = Setting.of(shapes, world=2, local_world=1, steps=STEPS, lr=lr)
    numel = sum(math.prod(s) for _, s in shapes)
    curves = {"DDP (every step, fp32 gradients)": [4 * numel * s / 1e6 for s in range(1, STEPS + 1)]}
    for label, conf in (("a sync every 4 steps, int2 (start_h4_int2)", config("start_h4_int2")),
                        ("the quadratic rule (qsr_gpt), int2",
                         config("qsr_gpt", payload="int2", payload_block=256, error_feedback=True))):
        declared = registry.declared_traffic(conf, setting)
        total, cumulative = 0, []
        for s in range(1, STEPS + 1):
            total += declared.bytes_at(s)
            cumulative.append(total / 1e6)
        curves[label] = cumulative
    return curves


def draw_traffic(shapes, out: Path) -> dict:
    curves = traffic(shapes)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, ys in curves.items():
        ax.plot(range(1, STEPS + 1), ys, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MB one rank has sent (log)")
    ax.set_title("What one rank sends over a run: byte-level GPT, 2 nodes")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "traffic.png", dpi=110)
    plt.close(fig)
    return {label: ys[-1] for label, ys in curves.items()}


def draw_period(out: Path) -> dict:
    conf = config("qsr_gpt")
    starts, periods, step = [], [], 0
    while step < STEPS:
        h = qsr_period(step, lr(step), conf)
        starts.append(step)
        periods.append(h)
        step += h
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.step(starts, periods, where="post", label="H, the steps until the next sync")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("period H (steps)")
    ax.set_title(f"The quadratic rule: H = max(h_base, floor((alpha/lr)^2)), h_base {conf.h_base}, alpha {conf.alpha}")
    twin = ax.twinx()
    twin.plot(range(STEPS), [lr(s) for s in range(STEPS)], color="grey", alpha=0.6, label="learning rate")
    twin.set_ylabel("learning rate")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "period.png", dpi=110)
    plt.close(fig)
    return {"syncs": len(starts) - 1, "first": periods[0], "last": periods[-1], "longest": max(periods)}


def _box(ax, x, y, w, h, text, color):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)


def _arrow(ax, a, b, text, color, rad=0.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="<->", mutation_scale=10, color=color,
                                 connectionstyle=f"arc3,rad={rad}"))
    if text:  # at the arc's peak (an arc's height is rad times half the chord)
        peak = (a[1] + b[1]) / 2 + abs(rad) * abs(b[0] - a[0]) / 2
        ax.text((a[0] + b[0]) / 2, peak + 0.08, text, ha="center", fontsize=7, color=color,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})


def draw_groups(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for node, x0 in enumerate((0.3, 5.0)):
        ax.add_patch(Rectangle((x0 - 0.2, 0.3), 4.0, 2.9, facecolor="none", edgecolor="grey", linestyle="--"))
        ax.text(x0 + 1.8, 0.38, f"node {node}: replica group {node}", ha="center", fontsize=9)
        for r in range(2):
            _box(ax, x0 + r * 2.0, 1.05, 1.6, 1.15, f"rank {2 * node + r}\nsyncs half {r}", "#dbe9f6")
        _arrow(ax, (x0 + 1.6, 1.6), (x0 + 2.0, 1.6), "", "tab:green")
        ax.text(x0 + 1.8, 0.72, "every step: DDP inside the node (fast link)", ha="center", fontsize=7,
                color="tab:green")
    for r in range(2):
        _arrow(ax, (0.3 + r * 2.0 + 0.8, 2.2), (5.0 + r * 2.0 + 0.8, 2.2), f"every H steps: half {r}, int2",
               "tab:red", rad=-0.25)
    ax.set_xlim(0, 9.4)
    ax.set_ylim(0, 4.2)
    ax.axis("off")
    ax.set_title("Replica groups, hierarchical sync: the slow link carries one model's worth per sync, not one per GPU",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "groups.png", dpi=110)
    plt.close(fig)


def draw_overlap(out: Path) -> None:
    """The same sync (1.4 steps long on the wire) blocking, and sent after step 4 to land after step 5: step 5
    hides 1.0 of it, the landing waits for the rest (what ``report()``'s ``hidden_share`` measures)."""
    fig, axes = plt.subplots(2, 1, figsize=(8, 3.4), sharex=True, layout="constrained")
    flight = 1.4
    for ax, overlapped in zip(axes, (False, True)):
        t = 0.0
        for step in range(1, 7):
            _box(ax, t, 0.55, 1.0, 0.35, f"step {step}", "#dbe9f6")
            t += 1.0
            if step == 4 and not overlapped:
                _box(ax, t, 0.55, flight, 0.35, "sync (the ranks wait)", "#f6d5d5")
                t += flight
            if step == 5 and overlapped:
                _box(ax, t, 0.55, flight - 1.0, 0.35, "wait", "#f6d5d5")
                t += flight - 1.0
        if overlapped:
            _box(ax, 4.0, 0.1, flight, 0.3, "sync in flight", "#f6d5d5")
            ax.annotate("lands after step 5", (5.4, 0.3), (5.9, 0.15), fontsize=7, arrowprops={"arrowstyle": "->"})
        ax.set_ylim(0, 1.0)
        ax.set_yticks([])
        ax.set_ylabel("overlap 1" if overlapped else "blocking", fontsize=8)
    axes[-1].set_xlabel("time (one step = 1)")
    axes[0].set_title("A sync sent after step 4: blocking, or landing a step later (overlap_steps 1)", fontsize=9)
    axes[0].set_xlim(0, 8)
    fig.savefig(out / "overlap.png", dpi=110)
    plt.close(fig)


def main(out: Path = OUT) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    shapes = gpt_shapes()
    facts = {"traffic_mb": draw_traffic(shapes, out), "period": draw_period(out)}
    draw_groups(out)
    draw_overlap(out)
    return facts


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT), indent=2))
