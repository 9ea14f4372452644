#!/usr/bin/env bash
# Train with a commhooks hook inside a DeepSpeed engine, configured by the "comm_hook"
# section of the DeepSpeed JSON.
#
#   NUM_GPUS=2 DS_CONFIG=configs/ds_ab_mnist1d.json launchers/deepspeed.sh [extra train args]
#
# On CPU (this machine) DeepSpeed's launcher starts NUM_GPUS CPU ranks on gloo.
# Multi-node: write a hostfile ("node01 slots=4" per line) and add
#   --hostfile hostfile --num_nodes N   (and drop --num_gpus, or keep it per node)
# ZeRO 0-2 with bf16/fp16 work (configs/ds_qsr_bf16_zero2.json: 4 ranks in replica pairs); ZeRO-3 is refused.
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_GPUS=${NUM_GPUS:-2}
DS_CONFIG=${DS_CONFIG:-configs/ds_ab_mnist1d.json}
MASTER_PORT=${MASTER_PORT:-29512}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export COMMHOOKS_CACHE=${COMMHOOKS_CACHE:-$PWD/.cache}   # DeepSpeed's JIT ops are built under it
exec .venv/bin/deepspeed --num_gpus "$NUM_GPUS" --master_port "$MASTER_PORT" --module commhooks.tools.train \
    --backend deepspeed --deepspeed_config "$DS_CONFIG" "$@"
