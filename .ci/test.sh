#!/usr/bin/env bash
# `make test`: the whole suite on torch 2.13, then its core on the oldest torch setup.cfg accepts
# (.ci/oldest-torch.sh), and at the end the wall time and the 10 slowest tests, whatever failed.
#
# Each leg runs in two phases: the tests that time nothing on TEST_WORKERS pytest-xdist workers (default 2, the
# cores here; tests that share a module fixture are kept on one worker by an xdist_group), then the tests marked
# `serial` alone, on a quiet machine (a deadline, a heartbeat, a port nobody reserved: see pyproject.toml).
# Reports go to .cache/test-reports/*.xml (JUnit), which .ci/slowest.py reads.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
WORKERS=${TEST_WORKERS:-2}
REPORTS=.cache/test-reports
rm -rf "$REPORTS" && mkdir -p "$REPORTS"
start=$(date +%s)
status=0

phase() {  # phase NAME PYTEST-ARGS...: one pytest run; exit 5 (nothing selected) is not a failure
    local name=$1; shift
    echo "test: $name"
    "$VENV/bin/python" -m pytest -q --junitxml="$REPORTS/$name.xml" "$@"
    local rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}

phase parallel -n "$WORKERS" --dist loadgroup -m "not serial"
phase serial -m serial
echo "test: the core on the oldest torch"
bash .ci/oldest-torch.sh || status=$?

"$VENV/bin/python" .ci/slowest.py --since "$start" "$REPORTS"/*.xml
exit "$status"
