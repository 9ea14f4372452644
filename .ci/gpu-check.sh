#!/usr/bin/env bash
# The GPU check (tests/gpu) on a bare, borrowed GPU host: no make, no package index, no network.
#
#   bash .ci/gpu-check.sh [OUT]        OUT: where the summary, the logs and the figures go
#                                      (default $GPU_CHECK_OUT, else results/gpu-check/<date>)
#
# 1. Picks the python that has CUDA (GPU_PY, else .venv's, else python3) and prints python, torch, CUDA, NCCL
#    and the GPU first.  Without CUDA it says so and exits 0 (COMMHOOKS_GPU_CHECK_ON_CPU=1 runs the checks'
#    logic on the CPU instead: how the suite keeps this script working).
# 2. What that python lacks comes from the bundle (`make gpu-bundle` on a machine with an index writes
#    .cache/gpu-bundle; carry it): installed with pip --no-index --no-deps into .cache/gpu-site, put first on
#    PYTHONPATH.  A missing bundle, or a package still missing after it, is named, and the script exits 2.
# 3. Runs each test file under its own time limit (one hang cannot eat the budget), with a JUnit report each.
# 4. Writes OUT/summary.json and OUT/summary.md (passed / failed / skipped per file, seconds, the figures of
#    OUT/gpu-check.jsonl) and exits 1 if any file failed or timed out.
# Budget: under 8 minutes on one H100 (the limits below add up to 7.75 minutes at worst).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${GPU_CHECK_OUT:-results/gpu-check/$(date +%F)}}
BUNDLE=${GPU_BUNDLE:-.cache/gpu-bundle}
SITE=${GPU_SITE:-.cache/gpu-site}
case $BUNDLE in /*) ;; *) BUNDLE=$PWD/$BUNDLE ;; esac
case $SITE in /*) ;; *) SITE=$PWD/$SITE ;; esac
# file: seconds (their sum is the worst case); GPU_CHECK_FILES="a.py b.py" runs only those
LIMITS="test_gpu_nccl.py:60 test_gpu_ranks.py:150 test_gpu_checkpoint.py:60 test_gpu_syncs.py:45 test_gpu_memory.py:60 test_gpu_deepspeed.py:90"
if [ -n "${GPU_CHECK_FILES:-}" ]; then
    chosen=""
    for f in $GPU_CHECK_FILES; do
        f=$(basename "$f")
        e=$(for e in $LIMITS; do [ "${e%%:*}" = "$f" ] && echo "$e"; done)
        [ -n "$e" ] || { echo "gpu-check: GPU_CHECK_FILES names $f, not a file of tests/gpu (${LIMITS//:[0-9]*/})" >&2; exit 2; }
        chosen="$chosen $e"
    done
    LIMITS=$chosen
fi

has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
PY=${GPU_PY:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && has_cuda .venv/bin/python; then PY=.venv/bin/python
    elif command -v python3 >/dev/null && has_cuda python3; then PY=python3
    elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
    else PY=python3
    fi
fi
mkdir -p "$OUT/logs" "$OUT/junit"
OUT=$(cd "$OUT" && pwd)
export GPU_CHECK_OUT="$OUT"
rm -f "$OUT"/junit/*.xml "$OUT"/logs/*.rc "$OUT/gpu-check.jsonl" "$OUT/summary.json" "$OUT/summary.md"  # this run's only

"$PY" - "$OUT/versions.json" <<'PY'
import json, platform, sys
import torch
v = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
     "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    v["gpu"] = torch.cuda.get_device_name(0)
    v["gpus"] = torch.cuda.device_count()
    try:
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # noqa: BLE001
        v["nccl"] = f"unknown ({exc})"
print("gpu-check: " + ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "cuda", "nccl", "gpu") if k in v))
json.dump(v, open(sys.argv[1], "w"), indent=1)
PY
[ $? -eq 0 ] || { echo "gpu-check: $PY cannot import torch" >&2; exit 2; }

if ! has_cuda "$PY" && [ "${COMMHOOKS_GPU_CHECK_ON_CPU:-}" != "1" ]; then
    echo "gpu-check: CUDA is not available to $PY (torch.cuda.is_available() is False): nothing to check here;" \
         "run this script on a GPU host (COMMHOOKS_GPU_CHECK_ON_CPU=1 runs the checks' logic on the CPU)"
    echo '{"skipped": "CUDA is not available"}' > "$OUT/summary.json"
    exit 0
fi

# what tests/gpu needs beyond torch: import name = package
NEEDS="pydantic=pydantic pydantic_core=pydantic-core annotated_types=annotated-types typing_inspection=typing-inspection hostlist=python-hostlist hjson=hjson deepspeed=deepspeed msgpack=msgpack einops=einops pytest=pytest pytest_timeout=pytest-timeout"
missing() {
    PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - $NEEDS <<'PY'
import importlib.util, sys
print(" ".join(pkg for mod, pkg in (a.split("=") for a in sys.argv[1:]) if importlib.util.find_spec(mod) is None))
PY
}
lacking=$(missing)
if [ -n "$lacking" ]; then
    if ! ls "$BUNDLE"/*.whl >/dev/null 2>&1; then
        echo "gpu-check: $PY lacks: $lacking; and the bundle $BUNDLE is not here (make gpu-bundle on a machine" \
             "with a package index, then carry the folder)" >&2
        exit 2
    fi
    echo "gpu-check: installing the bundle ($(ls "$BUNDLE"/*.whl | wc -l) wheels) into $SITE for: $lacking"
    rm -rf "$SITE"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$SITE" "$BUNDLE"/*.whl \
            > "$OUT/logs/bundle-install.log" 2>&1
    else  # no pip: a wheel is a zip of what goes into site-packages
        "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
            "$SITE" "$BUNDLE"/*.whl > "$OUT/logs/bundle-install.log" 2>&1
    fi
    if [ $? -ne 0 ]; then
        echo "gpu-check: installing the bundle failed:" >&2; tail -5 "$OUT/logs/bundle-install.log" >&2; exit 2
    fi
    lacking=$(missing)
    if [ -n "$lacking" ]; then
        echo "gpu-check: still missing after the bundle: $lacking (add it to .ci/gpu-bundle.txt)" >&2
        exit 2
    fi
fi
export PYTHONPATH="$SITE:$PWD/hooks:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}

# CPU mode (the suite, two cores) is slower than a GPU host's 16: three times the limits
scale=1; [ "${COMMHOOKS_GPU_CHECK_ON_CPU:-}" = "1" ] && ! has_cuda "$PY" && scale=3
status=0
for entry in $LIMITS; do
    file=${entry%%:*}; limit=$(( ${entry##*:} * scale ))
    name=${file%.py}
    start=$(date +%s)
    timeout -k 10 "$limit" "$PY" -m pytest -q -s -p no:cacheprovider -o addopts="" --timeout "$((limit - 5))" \
        --junitxml="$OUT/junit/$name.xml" "tests/gpu/$file" > "$OUT/logs/$name.log" 2>&1
    rc=$?
    echo "$rc $(( $(date +%s) - start ))" > "$OUT/logs/$name.rc"
    case $rc in
        0) echo "gpu-check: $file passed ($(( $(date +%s) - start )) s)" ;;
        124|137) echo "gpu-check: $file TIMED OUT after $limit s (log: $OUT/logs/$name.log)"; status=1 ;;
        *) echo "gpu-check: $file FAILED, rc $rc (log: $OUT/logs/$name.log)"; tail -15 "$OUT/logs/$name.log"; status=1 ;;
    esac
done

"$PY" - "$OUT" "$LIMITS" "$scale" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, scale = Path(sys.argv[1]), int(sys.argv[3])
limits = {f: int(s) * scale for f, s in (e.split(":") for e in sys.argv[2].split())}
files = {}
for file, limit in limits.items():
    name = file[:-3]
    rc, seconds = (out / "logs" / f"{name}.rc").read_text().split()
    row = {"rc": int(rc), "seconds": int(seconds), "limit": int(limit), "timed_out": rc in ("124", "137")}
    junit = out / "junit" / f"{name}.xml"
    try:  # none, or cut short, when the file timed out
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        row.update(passed=total - fail - err - skip, failed=fail + err, skipped=skip,
                   skip_reasons=sorted({s.get("message", "") for s in suite.iter("skipped")}))
    except (OSError, ET.ParseError) as exc:
        row.update(passed=None, failed=None, skipped=None, report=f"no JUnit report ({type(exc).__name__})")
    files[file] = row
figures = []
jsonl = out / "gpu-check.jsonl"
if jsonl.is_file():
    figures = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
summary = {"versions": json.loads((out / "versions.json").read_text()), "files": files, "figures": figures}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
lines = ["| file | passed | failed | skipped | seconds (limit) |", "|---|---|---|---|---|"]
for file, r in files.items():
    lines.append(f"| {file} | {r.get('passed', '-')} | {r.get('failed', '-')}{' (timed out)' if r['timed_out'] else ''} "
                 f"| {r.get('skipped', '-')} | {r['seconds']} ({r['limit']}) |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
[ $? -eq 0 ] || { echo "gpu-check: the summary could not be written" >&2; status=1; }
echo "gpu-check: summary in $OUT/summary.json and $OUT/summary.md"
exit $status
