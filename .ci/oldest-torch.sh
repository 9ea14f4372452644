#!/usr/bin/env bash
# The core of the suite on the oldest torch setup.cfg accepts (part of `make test`, after the main suite).
#
# Why 2.11: it is what the borrowed GPU host runs (docs/pages/operations/gpus.md), and every torch feature the
# library reaches for is there (split_group, new_group's use_local_synchronization, init_process_group's
# device_id, Join).  Older releases are not tested, so setup.cfg does not accept them.  The CPU wheel of 2.11 is
# not on the package index: its CUDA build is (3.5 GB installed with its CUDA libraries, a minute or more here),
# and it runs on the CPU.  Its NCCL is the one the GPU host has, so the one-GPU NCCL recipe is checked against it.
#
# Core = the algorithms, the DDP adapter, checkpoints, the Comm; not Horovod, DeepSpeed, the frameworks or tools.
#
# The venv holds the dependencies only, and lives in the user cache (as the Horovod wheel does), keyed by the torch
# and Python versions and stamped with the hash of what it was made from: every clone on this machine reuses it,
# and a change of setup.cfg or of this script remakes it.  The package itself comes from this clone's hooks/
# (PYTHONPATH), so a venv made from another clone never tests that clone's code.  OLDEST_VENV overrides the place.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=$(sed -n 's/^\s*torch>=\([0-9.]*\).*/\1/p' setup.cfg)
[ -n "$TORCH_VERSION" ] || { echo "oldest-torch: no torch>=X line in setup.cfg" >&2; exit 1; }
pytag=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
VENV=${OLDEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/commhooks/venv-oldest-torch-$TORCH_VERSION-$pytag}
CORE_TESTS=${CORE_TESTS:-"tests/test_qsr.py tests/test_ab.py tests/test_outer.py tests/test_streaming.py tests/test_exchange.py tests/test_payloads.py tests/test_alignment.py tests/test_run_end.py tests/test_comm.py tests/test_contract.py tests/oldest_torch"}

stamp="$VENV/.commhooks-installed"
want=$( (cat setup.cfg pyproject.toml .ci/oldest-torch.sh; echo "$TORCH_VERSION") | sha256sum | cut -d' ' -f1)
if ! { [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
    mkdir -p "$(dirname "$VENV")"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    constraints=$(mktemp)
    echo "torch==$TORCH_VERSION" > "$constraints"
    echo "oldest-torch: torch==$TORCH_VERSION and the core's dependencies into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints" "torch==$TORCH_VERSION" numpy
    # the package's own dependencies (setup.cfg), then the package removed again: this clone's hooks/ is the code
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints" ".[test,tools]"
    "$VENV/bin/python" -m pip uninstall -q -y commhooks
    rm -f "$constraints"
    echo "$want" > "$stamp"
else
    echo "oldest-torch: reusing $VENV"
fi
export PYTHONPATH="$PWD/hooks${PYTHONPATH:+:$PYTHONPATH}"
"$VENV/bin/python" -c "import torch, commhooks; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__
assert commhooks.__file__.startswith('$PWD/hooks/'), commhooks.__file__; print('oldest-torch: torch', torch.__version__)"
status=0
set +e
. .ci/pytest-phases.sh
pytest_phases "$VENV/bin/python" oldest-torch -p no:cacheprovider -o addopts="-ra" $CORE_TESTS "$@"
exit "$status"
