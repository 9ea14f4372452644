#!/usr/bin/env bash
# `make test`: the whole suite on torch 2.13, then its core on the oldest torch setup.cfg accepts
# (.ci/oldest-torch.sh), and at the end the wall time and the 40 slowest tests, whatever failed.
#
# Each leg runs in two phases (.ci/pytest-phases.sh): the tests that time nothing on 2 pytest-xdist workers, then
# the tests marked `serial` alone, on a quiet machine (a deadline, a heartbeat, a port nobody reserved).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
REPORTS=.cache/test-reports
rm -rf "$REPORTS"
start=$(date +%s)
status=0
. .ci/pytest-phases.sh

echo "test: lint (ruff, pyproject.toml's rules)"
"$VENV/bin/ruff" check --no-cache hooks tests docs examples .ci || status=1

pytest_phases "$VENV/bin/python" main
echo "test: the core on the oldest torch"
bash .ci/oldest-torch.sh || status=$?

"$VENV/bin/python" .ci/slowest.py --since "$start" --top 40 "$REPORTS"/*.xml
exit "$status"
