#!/usr/bin/env bash
# The recorded live-recovery run with replica groups of 2 ranks: GPT, 2 replica groups of 2 processes each (DDP
# inside a group, one torchft Manager per rank: rank i syncs with rank i of the other group; loopback), QSR with
# int2 payloads over the allgather (timeout_s 15), ${STEPS:-800} steps; a group hit at a mean of one fault per 20 s
# of job time (the schedule's seed = the training seed): one of its ranks, drawn from the seed, SIGKILLed, the
# other stopped by the injector, the whole group started again 2 s later to heal from the live group; each seed
# also runs once without faults.  Run from the repository root (PYTHON: the interpreter with commhooks[torchft]).
set -euo pipefail
here=results/faults-live-gpt-2x2-2026-12-06
for seed in ${SEEDS:-0 1 2}; do
    "${PYTHON:-.venv/bin/python}" -m commhooks.cli faults --torchft --ranks 2 --group-ranks 2 --mtbf 20 \
        --seed "$seed" --kinds kill --reference --out "$here/seed$seed" -- \
        --model gpt --steps "${STEPS:-800}" --seed "$seed" --config "$here/qsr_int2_gpt_live.json"
done
