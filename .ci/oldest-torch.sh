#!/usr/bin/env bash
# The core of the suite on the oldest torch setup.cfg accepts (part of `make test`, after the main suite).
#
# Why 2.11: it is what the borrowed GPU host runs (docs/pages/operations/gpus.md), and every torch feature the
# library reaches for is there (split_group, new_group's use_local_synchronization, init_process_group's
# device_id, Join).  Older releases are not tested, so setup.cfg does not accept them.  The CPU wheel of 2.11 is
# not on the package index: its CUDA build is (3.5 GB installed with its CUDA libraries, about a minute here),
# and it runs on the CPU.  Its NCCL is the one the GPU host has, so the one-GPU NCCL recipe is checked against it.
#
# Core = the algorithms, the DDP adapter, checkpoints, the Comm; not Horovod, DeepSpeed, the frameworks or tools.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OLDEST_VENV:-.venv-oldest-torch}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=$(sed -n 's/^\s*torch>=\([0-9.]*\),.*/\1/p' setup.cfg)
[ -n "$TORCH_VERSION" ] || { echo "oldest-torch: no torch>=X,... line in setup.cfg" >&2; exit 1; }
CORE_TESTS=${CORE_TESTS:-"tests/test_qsr.py tests/test_ab.py tests/test_outer.py tests/test_streaming.py tests/test_exchange.py tests/test_payloads.py tests/test_alignment.py tests/test_run_end.py tests/test_comm.py tests/test_contract.py tests/oldest_torch"}

stamp="$VENV/.commhooks-installed"
want=$( (cat setup.cfg pyproject.toml .ci/oldest-torch.sh; echo "$TORCH_VERSION") | sha256sum | cut -d' ' -f1)
if ! { [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    constraints=$(mktemp)
    echo "torch==$TORCH_VERSION" > "$constraints"
    echo "oldest-torch: torch==$TORCH_VERSION into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints" "torch==$TORCH_VERSION" \
        numpy pytest pytest-timeout hypothesis
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$constraints" -e ".[test,tools]"
    rm -f "$constraints"
    echo "$want" > "$stamp"
fi
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__; print('oldest-torch: torch', torch.__version__)"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="-ra --durations=10" $CORE_TESTS "$@"
