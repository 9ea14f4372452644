#!/usr/bin/env bash
# `make gpu-check`: the checks only a CUDA GPU can run (tests/gpu), on a GPU host.
#
# It runs with the python that has CUDA there (GPU_PY, default: .venv's if it sees a GPU, else python3): a lent
# GPU machine has its own torch and cannot reach a package index, so commhooks is used from the source tree
# (PYTHONPATH) and what that python lacks (pydantic, python-hostlist, DeepSpeed) is installed from the wheels
# in .cache/gpu-wheels if they are there (`make gpu-wheels` fetches them on a machine with the index).
# Figures go to $GPU_CHECK_OUT (default results/gpu-check/<date>), one JSON line per check.
# Without CUDA every test is skipped, saying so; COMMHOOKS_GPU_CHECK_ON_CPU=1 runs the checks' logic on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PY:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY=.venv/bin/python
    elif command -v python3 >/dev/null && python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY=python3
    else
        PY=${VENV_PY:-.venv/bin/python}
        [ -x "$PY" ] || PY=python3
    fi
fi
missing=$("$PY" - <<'PY'
import importlib.util as u
print(" ".join(m for m, mod in (("pydantic", "pydantic"), ("python-hostlist", "hostlist"), ("pytest", "pytest"),
                                 ("pytest-timeout", "pytest_timeout"), ("deepspeed", "deepspeed")) if u.find_spec(mod) is None))
PY
)
if [ -n "$missing" ] && [ -d .cache/gpu-wheels ]; then
    echo "gpu-check: installing $missing from .cache/gpu-wheels"
    "$PY" -m pip install -q --no-index --find-links .cache/gpu-wheels $missing || echo "gpu-check: could not install all of: $missing"
fi
export PYTHONPATH="$PWD/hooks:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_OUT=${GPU_CHECK_OUT:-results/gpu-check/$(date +%F)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
mkdir -p "$GPU_CHECK_OUT"
"$PY" -c "import torch; print('gpu-check: python', __import__('sys').executable, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
exec "$PY" -m pytest -q -s -p no:cacheprovider -o addopts="" --timeout 600 tests/gpu "$@"
