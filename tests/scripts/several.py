"""Several runs of one framework script in one launch: the imports (torch, transformers, the framework: about 4 of
a launch's 5 s of CPU per rank here) paid once, not once a run.

    torchrun --nproc_per_node 2 tests/scripts/several.py SCRIPT.py '[["--out", "A", ...], ["--out", "B", ...]]'

Each run is SCRIPT.py run as ``__main__`` with its own arguments, one after the other in the same processes and
process group, with a barrier between runs (a run may read the checkpoint the one before it wrote).  Between runs,
Accelerate's process-wide state (the mixed precision, the accumulation steps) is forgotten, as Accelerate's own
tests do, so that a run may choose other settings than the run before it; the process group stays."""

import json
import runpy
import sys
from pathlib import Path

import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
script = HERE / sys.argv[1]
for argv in json.loads(sys.argv[2]):
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    if dist.is_initialized():
        dist.barrier()
