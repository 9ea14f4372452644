#!/bin/bash
cd /work/run-gh
export PYTHONPATH=/work/run-gh/hooks COMMHOOKS_CACHE=/work/main/.cache OMP_NUM_THREADS=1
for isa in avx2; do
  ATEN_CPU_CAPABILITY=$isa MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 /work/main/.venv/bin/python -m commhooks.cli bench --model gpt --ranks 4 --nodes 2 --steps 1000 --netns off --bandwidths unlimited --seeds 0 --repeats 1 --methods ddp --out /tmp/ddp-$isa > /tmp/ddp-$isa.log 2>&1
done
