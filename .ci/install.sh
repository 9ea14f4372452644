#!/usr/bin/env bash
# One idempotent set-up for users and CI: creates .venv (if missing) and installs
# torch (pinned: a looser spec makes pip fetch a multi-GB CUDA build) and commhooks
# with its extras.  A stamp holding the hash of the inputs makes a second run a no-op.
# Build products and downloads are cached under .cache/ (ignored by git).
#
#   .ci/install.sh          everything the tests need (Horovod built, MPICH, DeepSpeed's ops, the docs toolchain)
#   .ci/install.sh core     torch and commhooks with its tools (the trainer, data, plots): what `make demo` needs
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-full}

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
EXTRAS=tools,test,mpi,deepspeed,horovod,frameworks,docs,torchft
CACHE=${COMMHOOKS_CACHE:-$PWD/.cache}

stamp="$VENV/.commhooks-installed"
core_stamp="$VENV/.commhooks-core-installed"
want=$(cat setup.cfg pyproject.toml .ci/install.sh | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "install: $VENV is up to date"
    exit 0
fi
if [ "$PROFILE" = core ] && [ -x "$VENV/bin/python" ] && [ -f "$core_stamp" ] && [ "$(cat "$core_stamp")" = "$want" ]; then
    echo "install: $VENV has the core (make test installs the rest)"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
mkdir -p "$CACHE"
constraints="$CACHE/constraints.txt"
echo "torch==$TORCH_VERSION" > "$constraints"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -c "$constraints")

echo "install: torch==$TORCH_VERSION"
"${pip[@]}" -q "torch==$TORCH_VERSION"

if [ "$PROFILE" = core ]; then
    echo "install: commhooks[tools] (editable)"
    "${pip[@]}" -q -e ".[tools]"
    "$VENV/bin/python" -c "import torch, commhooks; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
    echo "$want" > "$core_stamp"
    echo "install: done, the core ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
    exit 0
fi

# Horovod 0.28.1 is an sdist that needs patching for torch 2.x (its CMake files ask for C++14;
# torch's headers need C++17). Build a wheel once, keep it under .cache/wheels (and in the
# user cache, so another clone on this machine finds it), install it before the package so
# pip sees the `horovod` extra satisfied. A failed build fails the install, loudly.
HOROVOD_VERSION=0.28.1
pytag=$("$VENV/bin/python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
key="horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-$pytag"
wheels="$CACHE/wheels/$key"
user_wheels="${XDG_CACHE_HOME:-$HOME/.cache}/commhooks/wheels/$key"
if ! "$VENV/bin/python" -c "import horovod.torch" 2>/dev/null; then
    if ! ls "$wheels"/horovod-*.whl >/dev/null 2>&1 && ls "$user_wheels"/horovod-*.whl >/dev/null 2>&1; then
        mkdir -p "$wheels" && cp "$user_wheels"/* "$wheels"/
    fi
    if ! ls "$wheels"/horovod-*.whl >/dev/null 2>&1; then
        echo "install: building Horovod $HOROVOD_VERSION against torch $TORCH_VERSION (several minutes on 2 cores)"
        "${pip[@]}" -q "cmake<4" wheel setuptools packaging psutil pyyaml cloudpickle
        src="$CACHE/horovod-src"
        mkdir -p "$src"
        ls "$src"/horovod-$HOROVOD_VERSION.tar.gz >/dev/null 2>&1 || \
            "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$src" "horovod==$HOROVOD_VERSION"
        build="$CACHE/horovod-build"
        rm -rf "$build" && mkdir -p "$build"
        tar xzf "$src/horovod-$HOROVOD_VERSION.tar.gz" -C "$build"
        tree="$build/horovod-$HOROVOD_VERSION"
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$tree/CMakeLists.txt" "$tree/horovod/torch/CMakeLists.txt"
        grep -q "CMAKE_CXX_STANDARD 17" "$tree/CMakeLists.txt" "$tree/horovod/torch/CMakeLists.txt"
        rm -rf "$wheels.tmp"
        start=$(date +%s)
        PATH="$VENV/bin:$PATH" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
            HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS=-j$(nproc) \
            "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$wheels.tmp" "$tree"
        mv "$wheels.tmp" "$wheels"
        echo "$(( $(date +%s) - start ))" > "$wheels/build-seconds"
        echo "install: Horovod built in $(cat "$wheels/build-seconds") s"
        mkdir -p "$user_wheels" && cp "$wheels"/* "$user_wheels"/ || true
        rm -rf "$build"
    fi
    "${pip[@]}" -q "$wheels"/horovod-*.whl
fi
echo "install: commhooks[$EXTRAS] (editable)"
"${pip[@]}" -q -e ".[$EXTRAS]"

# MPICH beside the venv's Open MPI, for the mpiexec tests and users of MPICH-family launchers:
# select its library with MPI4PY_LIBMPI=$CACHE/mpich/lib/libmpi.so.12 (launchers/mpirun.sh does).
if [ ! -x "$CACHE/mpich/bin/mpiexec" ]; then
    echo "install: mpich into $CACHE/mpich"
    "${pip[@]}" -q --prefix "$CACHE/mpich" mpich
fi

# DeepSpeed compiles its CPU ops (the shared-memory allreduce every engine loads, the fused Adam) with g++ on first
# use: about 2 minutes of both cores.  Build them here, once per clone, into the cache the tests and the trainer
# point TORCH_EXTENSIONS_DIR at, so no test pays for it.  Built in a side folder and moved in whole: a build killed
# half way leaves torch's lock file behind, and every later run would wait on it forever.
ext="$CACHE/torch_extensions"
if [ ! -f "$ext/.built" ]; then
    echo "install: DeepSpeed's CPU ops into $ext (about 2 min)"
    rm -rf "$ext.tmp" && mkdir -p "$ext.tmp"
    TORCH_EXTENSIONS_DIR="$(realpath -m "$ext.tmp")" OMP_NUM_THREADS=1 MAX_JOBS=$(nproc) "$VENV/bin/python" - <<'PY'
from deepspeed.accelerator import get_accelerator
for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
    builder = get_accelerator().create_op_builder(name)
    if builder is not None:
        builder.load(verbose=False)
PY
    rm -rf "$ext" && mv "$ext.tmp" "$ext" && touch "$ext/.built"
fi

"$VENV/bin/python" -c "import torch, commhooks; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
echo "$want" > "$stamp"
echo "install: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
