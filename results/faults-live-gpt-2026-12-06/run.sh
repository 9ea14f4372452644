#!/usr/bin/env bash
# The recorded live-recovery run (docs/pages/operations/fault-tolerance.md): GPT, 2 replica groups of one process
# each over torchft (loopback), QSR with int2 payloads over the allgather (timeout_s 15), 800 steps; a group
# SIGKILLed at a mean of one fault per 20 s of job time (the schedule's seed = the training seed), started again
# 2 s later to heal from a live group; each seed also runs once without faults.  Run from the repository root.
set -euo pipefail
here=results/faults-live-gpt-2026-12-06
for seed in ${SEEDS:-0 1 2}; do
    .venv/bin/commhooks faults --torchft --ranks 2 --mtbf 20 --seed "$seed" --kinds kill --reference \
        --out "$here/seed$seed" -- --model gpt --steps 800 --seed "$seed" --config "$here/qsr_int2_gpt_live.json"
done
