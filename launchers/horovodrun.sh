#!/usr/bin/env bash
# Train with a commhooks hook under horovodrun (Gloo controller, as built by `make`).
#
#   NP=2 HOOK=ab CONFIG=configs/ab_mnist1d.json launchers/horovodrun.sh [extra train args]
#
# Multi-node: HOSTS="node01:4,node02:4" NP=8 (horovodrun needs passwordless ssh between
# the hosts); AB groups become Horovod process sets (commhooks.horovod.init creates them
# statically at hvd.init, the same on every rank).
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
HOSTS=${HOSTS:-localhost:$NP}
HOOK=${HOOK:-ab}
CONFIG=${CONFIG:-configs/ab_mnist1d.json}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/horovodrun -np "$NP" -H "$HOSTS" --gloo .venv/bin/python -m commhooks.tools.train \
    --backend horovod --hook "$HOOK" --config "$CONFIG" "$@"
