"""Restart trials of examples/ddp_restarts.py under ``torchrun --max-restarts 3``: rank 1 SIGKILLed after the
first checkpoint (tests/scripts/kill_after_checkpoint), N tries; each try's starts per rank, exit code, time and
final checksum, as JSON lines.  A clean try starts each rank twice (the first attempt, one restart) and ends with
the fault-free checksum.

    python tests/scripts/restart_trials.py --tries 20 --out results/restarts-2026-12-06/init_distributed.jsonl
    python tests/scripts/restart_trials.py --tries 10 --plain --out .../plain.jsonl   # dist.init_process_group

``--summary DIR`` counts each ``*.jsonl`` of DIR into ``DIR/summary.json`` (what the docs' claims read).

``--plain`` runs a copy of the example whose only change is the plain ``dist.init_process_group(...)`` in place
of ``commhooks.launch.init_distributed()`` (what the example used before 2026-12-06), with a per-try timeout.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ddp_restarts.py"


def plain_copy(folder: Path) -> Path:
    text = EXAMPLE.read_text()
    call = "placement = commhooks.launch.init_distributed()"
    assert call in text, "the example no longer calls init_distributed as this script expects"
    text = text.replace(call, 'dist.init_process_group("gloo"); placement = {"local_rank": int(os.environ["LOCAL_RANK"])}')
    path = folder / "ddp_restarts_plain.py"
    path.write_text(text)
    return path


def one_try(script: Path, out: Path, timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "SLURM_", "MASTER_"))}
    env.update(OUT=str(out), KILL_STEP="150", KILL_RANK="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO / "tests" / "scripts" / "kill_after_checkpoint"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts",
           "3", str(script)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = "timeout", (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
    starts = sorted(p.name for p in (out / "attempts").iterdir()) if (out / "attempts").is_dir() else []
    sums = sorted(set(re.findall(r"checksum (-?[\d.]+)", text)))
    return {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "starts": starts,
            "restarts": max([int(s.rsplit("attempt", 1)[1]) for s in starts] or [0]),
            "checksums": sums, "connection_refused": "Connection refused" in text,
            "resumed_from_100": text.count("resumed from step 100")}


def counts(rows: list) -> dict:
    """Tries by outcome: clean (one restart, the fault-free checksum on both ranks), restarted more than once
    then finished, used up torchrun's restarts (exit 1), hung (the per-try timeout)."""
    finished = [r for r in rows if r["rc"] == 0 and len(r["checksums"]) == 1 and r["resumed_from_100"] == 2]
    return {"tries": len(rows), "clean": sum(r["restarts"] == 1 for r in finished),
            "restarted_more_then_finished": sum(r["restarts"] > 1 for r in finished),
            "restarts_used_up": sum(r["rc"] not in (0, "timeout") for r in rows),
            "hung": sum(r["rc"] == "timeout" for r in rows),
            "connection_refused": sum(r["connection_refused"] for r in rows),
            "restarts_of_unclean": [r["restarts"] for r in finished if r["restarts"] > 1]}


def summarize(folder: Path) -> None:
    summary = {f.stem: counts([json.loads(line) for line in f.read_text().splitlines() if line.strip()])
               for f in sorted(folder.glob("*.jsonl"))}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=20)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--summary", type=Path, help="a folder of trials (*.jsonl): write its summary.json")
    args = p.parse_args()
    if args.summary is not None:
        return summarize(args.summary)
    if args.out is None:
        p.error("--out FILE.jsonl is needed to run trials (or --summary DIR)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, args.out.open("w") as log:
        script = plain_copy(Path(tmp)) if args.plain else EXAMPLE
        for i in range(args.tries):
            row = {"try": i, **one_try(script, Path(tmp) / f"try{i}", args.timeout)}
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
