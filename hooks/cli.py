"""``commhooks`` console script: ``train`` (under a launcher) and ``table`` (compare run summaries)."""

from __future__ import annotations

import json
import sys
from typing import Optional, Sequence


def nbytes(run: dict) -> int:
    """The meter's bytes, or what reached torch.distributed for PyTorch's own hooks."""
    return run["bytes_per_rank"] if run["bytes_per_rank"] is not None else (run.get("payload_bytes_per_rank") or 0)


def table(paths: Sequence[str]) -> str:
    """A markdown table of run summaries (JSON files from ``train --json-out``), first row = baseline."""
    runs = [json.load(open(p)) for p in paths]
    if not runs:
        return "no runs"
    base = nbytes(runs[0]) or 1
    lines = [
        "| run | test acc | train loss | bytes/rank | vs first | syncs | steps | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['label']} | {r['test_acc']:.4f} | {r['train_loss']:.4f} | {nbytes(r) / 1e6:.2f} MB "
            f"| {nbytes(r) / base:.3f} | {r['syncs']} | {r['steps']} | {r['wall_s']:.1f} s |"
        )
    return "\n".join(lines)


USAGE = """usage: commhooks <command> [options]

commands:
  train   train MNIST-1D with a hook; start it under a launcher, e.g.
          torchrun --standalone --nproc_per_node 2 -m commhooks.train --hook qsr
  bench   run every method side by side (network namespaces + tc when root), see `commhooks bench -h`
  table   print a markdown table of summaries written by `train --json-out`
"""


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from .train import main as train_main

        return train_main(rest)
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    if command == "table":
        print(table(rest))
        return 0
    print(f"commhooks: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
