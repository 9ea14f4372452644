#!/usr/bin/env bash
# Train MNIST-1D with a commhooks hook under torchrun (single node).
#   NPROC=2 HOOK=qsr CONFIG=configs/qsr_mnist1d.json launchers/torchrun.sh [extra train args]
# Multi-node: replace --standalone by --nnodes N --node_rank R --rdzv_endpoint HOST:PORT.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NPROC=${NPROC:-2}
HOOK=${HOOK:-qsr}
CONFIG=${CONFIG:-configs/qsr_mnist1d.json}
exec .venv/bin/torchrun --standalone --nproc_per_node "$NPROC" -m commhooks.tools.train \
    --hook "$HOOK" --config "$CONFIG" "$@"
