#!/usr/bin/env bash
# The recorded fault run (docs/pages/operations/fault-tolerance.md): GPT, 4 ranks on 2 simulated nodes at
# 100 Mbit/s, QSR with int2 payloads (configs/qsr_int2_hier_gpt.json, timeout_s 15), 400 steps, a checkpoint
# every 10 s; faults at a mean of one per 30 s of job time (kill, kill-node, stall 25 s, link down 25 s), the
# schedule's seed = the training seed; each seed also runs once without faults.  Run from the repository root.
set -euo pipefail
here=results/faults-gpt-2026-12-06
for seed in ${SEEDS:-0 1 2}; do
    .venv/bin/commhooks faults --ranks 4 --nodes 2 --bandwidth 100mbit --mtbf 30 --seed "$seed" \
        --kinds kill,kill-node,stall,link-down --stall-s 25 --down-s 25 --reference --out "$here/seed$seed" -- \
        --model gpt --steps 400 --seed "$seed" --config "$here/qsr_int2_hier_gpt_timeout15.json" --checkpoint-seconds 10
done
