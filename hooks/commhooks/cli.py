"""``commhooks`` console script (argparse subcommands).

* ``train``: train with a hook; start it under a launcher (``torchrun ... -m commhooks.tools.train``).
* ``bench``: every method side by side on a constrained network.
* ``curves``: the quadratic rule against a fixed period, each swept into a curve of quality against syncs.
* ``faults``: a training job with faults injected (kills, stalls, links down), restarted; what they cost.
* ``table``: a markdown table of summaries written by ``train --json-out``.
* ``schema``: the JSON schema of the ``comm_hook`` section, or the docs' key tables.

``train`` and ``bench`` need the ``commhooks[tools]`` extra; ``table`` and
``schema`` run with the library alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence


def nbytes(run: dict) -> int:
    """The meter's bytes, or what reached torch.distributed for PyTorch's own hooks."""
    return run["bytes_per_rank"] if run["bytes_per_rank"] is not None else (run.get("payload_bytes_per_rank") or 0)


class MixedRuns(ValueError):
    """Summaries of different commits in one table, not asked for with ``--mixed``."""


def table(paths: Sequence[str], mixed: bool = False) -> str:
    """A markdown table of run summaries (JSON files from ``train --json-out``), first row = baseline.

    Its ratios divide figures of different runs, so they must come from one commit (docs/pages/tools/measure.md: DDP's GPT
    loss moved between commits): summaries of several commits (or of none recorded beside one recorded) are
    refused with :class:`MixedRuns`, unless ``mixed``, and then the table says so under it."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    if not runs:
        return "no runs"
    code = commits_line(runs, paths, mixed)
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
    wall = ("'wall' is each run's time on the link it ran on: on an unlimited loopback (`make demo`) traffic costs "
            "almost nothing and DDP is fastest; for a slow link, `commhooks bench` (docs/pages/tools/bench.md).")
    return "\n".join(lines + ["", reading(runs), "", wall, "", code])


def commits_line(runs: Sequence[dict], paths: Sequence[str], mixed: bool) -> str:
    """The code the runs came from, in a sentence; :class:`MixedRuns` where they differ and ``mixed`` is off."""
    from .tools.provenance import describe  # the standard library only: table still runs without the tools extra

    by_commit: dict = {}
    for path, r in zip(paths, runs):
        by_commit.setdefault(describe(r.get("commit"), r.get("dirty")), []).append(Path(path).name)
    if len(by_commit) == 1:
        return f"All runs: {next(iter(by_commit))}."
    listed = "; ".join(f"{c}: {', '.join(names)}" for c, names in by_commit.items())
    if not mixed:
        raise MixedRuns(f"the summaries come from {len(by_commit)} commits ({listed}): a table divides figures of "
                        "one commit (rerun the baseline beside the others), or pass --mixed to make it anyway and "
                        "say so under it")
    return f"MIXED (--mixed): runs of {len(by_commit)} commits, so its ratios measure code changes too: {listed}."


def reading(runs: Sequence[dict], tolerance: float = 0.007) -> str:
    """The table in a sentence for a newcomer: what "vs first" means, and which run to try first (the fewest
    bytes among those within ``tolerance`` of the baseline's accuracy: 0.7 points, how much one seed's
    accuracy moves between machines)."""
    base = runs[0]
    text = (f"Reading: 'vs first' is the bytes each rank sent over the run divided by {base['label']}'s "
            f"(0.013 = 1.3 % of its traffic); accuracies within {100 * tolerance:.1f} points of each other are one "
            "seed's noise.")
    if len(runs) == 1 or base.get("test_acc") is None:
        return text
    close = [r for r in runs[1:] if r.get("test_acc") is not None and r["test_acc"] >= base["test_acc"] - tolerance]
    if not close:
        return text + f" No run here is within that of {base['label']}'s accuracy."
    best = min(close, key=nbytes)
    return (text + f" Try first: {best['label']} ({nbytes(best) / (nbytes(base) or 1):.1%} of the bytes, test acc "
                   f"{best['test_acc']:.3f} against {base['test_acc']:.3f}).")


def schema(args: argparse.Namespace) -> int:
    from . import config

    if args.readme is None:
        if args.markdown:
            from . import registry

            print("\n\n".join(f"### `{a.name}`\n\n{config.key_table(a.name)}" for a in registry.algorithms()))
        else:
            print(json.dumps(config.json_schema(), indent=2))
        return 0
    path = Path(args.readme)
    text = path.read_text()
    fresh = config.update_tables(text)
    if args.check:
        if fresh != text:
            print(f"commhooks schema: the key tables in {path} differ from the config classes; "
                  f"run `commhooks schema --readme {path}`", file=sys.stderr)
            return 1
        print(f"{path}: key tables match the config classes")
        return 0
    path.write_text(fresh)
    print(f"{path}: key tables regenerated")
    return 0


def configs() -> int:
    """``commhooks configs``: the shipped configs, by name, with their hook type and where they are."""
    from . import shipped
    from .config import read_json

    found = shipped.shipped_configs()
    if not found:
        print("no shipped configs found (looked in: " + ", ".join(str(d) for d in shipped.config_dirs()) + ")")
        return 1
    width = max(len(n) for n in found)
    for name, path in found.items():
        data = read_json(path)
        section = data.get("comm_hook", data)
        engine = "deepspeed" if "comm_hook" in data else "ddp/horovod"
        keys = ", ".join(f"{k}={v}" for k, v in section.items() if k != "type" and v not in (None, [], False))
        print(f"{name:<{width}}  {section.get('type', '?'):<4} {engine:<11} {keys[:90]}")
    print(f"\nload one by name: config=\"{next(iter(found))}\" (Python) or --config NAME (commhooks train); "
          f"folder: {path.parent}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commhooks", description=(
        "Communication-efficient training hooks for PyTorch DDP, Horovod and DeepSpeed. train and bench need "
        "the commhooks[tools] extra; table and schema run with the library alone."))
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    for name, text in (("train", "train with a hook (under a launcher); `commhooks train -h` for its options"),
                       ("bench", "run every method side by side; `commhooks bench -h` for its options"),
                       ("curves", "the quadratic rule against a fixed period, quality against syncs; "
                                  "`commhooks curves -h`"),
                       ("plan", "predict bytes and step time on a larger cluster; `commhooks plan -h`"),
                       ("faults", "a training job with faults injected and restarts; `commhooks faults -h`")):
        sub.add_parser(name, help=text, add_help=False)
    tab = sub.add_parser("table", help="markdown table of summaries written by `train --json-out`")
    tab.add_argument("summaries", nargs="+", help="JSON files; the first is the baseline")
    tab.add_argument("--mixed", action="store_true",
                     help="allow summaries of different commits in one table (refused otherwise); the table says so")
    sub.add_parser("configs", help="list the shipped configs (load one by name: config=\"qsr_mnist1d\")")
    sch = sub.add_parser("schema", help="JSON schema of the comm_hook section (or the docs' key tables)")
    sch.add_argument("--markdown", action="store_true", help="the key tables as markdown instead of the JSON schema")
    sch.add_argument("--readme", help="regenerate the key tables between the markers in this file")
    sch.add_argument("--check", action="store_true", help="with --readme: only check, exit 1 if they differ")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # train and bench own their options (argparse would take their --flags for ours)
    if argv[:1] == ["train"]:
        from .tools.train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["bench"]:
        from .tools.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["curves"]:
        from .tools.curves import main as curves_main

        return curves_main(argv[1:])
    if argv[:1] == ["faults"]:
        from .tools.faults import main as faults_main

        return faults_main(argv[1:])
    if argv[:1] == ["plan"]:
        from .tools.plan import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "table":
        try:
            print(table(args.summaries, args.mixed))
        except MixedRuns as exc:
            print(f"commhooks table: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "configs":
        return configs()
    return schema(args)


if __name__ == "__main__":
    sys.exit(main())
