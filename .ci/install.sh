#!/usr/bin/env bash
# One idempotent set-up for users and CI: creates .venv (if missing) and installs
# torch (pinned: a looser spec makes pip fetch a multi-GB CUDA build) and commhooks
# with its extras.  A stamp holding the hash of the inputs makes a second run a no-op.
# Build products and downloads are cached under .cache/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
EXTRAS=test,mpi,deepspeed
CACHE=${COMMHOOKS_CACHE:-$PWD/.cache}

stamp="$VENV/.commhooks-installed"
want=$(cat setup.cfg pyproject.toml .ci/install.sh | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "install: $VENV is up to date"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
mkdir -p "$CACHE"
constraints="$CACHE/constraints.txt"
echo "torch==$TORCH_VERSION" > "$constraints"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -c "$constraints")

echo "install: torch==$TORCH_VERSION"
"${pip[@]}" -q "torch==$TORCH_VERSION"
echo "install: commhooks[$EXTRAS] (editable)"
"${pip[@]}" -q -e ".[$EXTRAS]"

# MPICH beside the venv's Open MPI, for the mpiexec tests and users of MPICH-family launchers:
# select its library with MPI4PY_LIBMPI=$CACHE/mpich/lib/libmpi.so.12 (launchers/mpirun.sh does).
if [ ! -x "$CACHE/mpich/bin/mpiexec" ]; then
    echo "install: mpich into $CACHE/mpich"
    "${pip[@]}" -q --prefix "$CACHE/mpich" mpich
fi

"$VENV/bin/python" -c "import torch, commhooks; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
echo "$want" > "$stamp"
echo "install: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
