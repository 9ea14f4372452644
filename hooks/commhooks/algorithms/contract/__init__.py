"""The algorithm contract: what every commhooks algorithm is, and how the engines drive it.

Read in this order:

1. :mod:`.state`: :class:`AlgorithmHooks` (what an algorithm declares and overrides) and :class:`AlgorithmState`
   (what the engines drive: the step hooks, ``reduce_bucket``, ``sync``, ``finish``, ``state_dict``).
2. :mod:`.steps`: every training step and every sync from the contract's side: :class:`StepAlignment` (the
   optimizer step hooks, strays, the NaN/Inf guard) and :class:`SyncContext`, the narrow object a sync gets
   (the counters, the step proof and its check, the rounding seed, the failure context).
3. :mod:`.parameters`: the tensors a state covers, and an equal start. 4. :mod:`.checks`: collective checks that
turn divergence into the same error on every rank. 5. :mod:`.amp`, :mod:`.join`, :mod:`.report`: GradScaler, uneven
inputs under ``Join``, what a state reports.
"""

from .checks import DivergenceError, NonFiniteError
from .state import AlgorithmHooks, AlgorithmState
from .steps import STEP_PROOF_BYTES, SyncContext

__all__ = ["AlgorithmHooks", "AlgorithmState", "DivergenceError", "NonFiniteError", "STEP_PROOF_BYTES",
           "SyncContext"]
