"""A third algorithm written outside the package, registered through the public API only.

"Mean every step": every gradient is averaged over the world (as DDP's own
allreduce), and every ``period`` optimizer steps the parameters are averaged
too (a no-op numerically, since they are already equal: it exercises the
sync path, the counters and check_every).  No adapter knows it: the DDP,
Horovod and DeepSpeed adapters drive it through the AlgorithmState contract.
"""

from typing import Literal

from pydantic import Field
from typing_extensions import Annotated

import commhooks


class MeanEveryStepConfig(commhooks.HookConfig):
    type: Literal["mean-every-step"] = "mean-every-step"
    period: Annotated[int, Field(ge=1, description="optimizer steps between parameter averages")] = 3


class MeanEveryStepState(commhooks.AlgorithmState):
    reduces_gradients = True

    def reduce_gradients(self, grads, params, flat=None):
        return self.comm.allreduce([flat] if flat is not None else grads, op="mean", async_op=True, tag="grad")

    def after_step(self):
        if self.step % self.config.period == 0:
            self.sync()

    def sync(self):
        self.average([p for _, p in self.named_params], tag="sync")
        self.synced()


def mean_every_step_traffic(config, setting):
    """What a rank sends (the meter tests and ``commhooks plan --import toy_algorithm --config`` read it): every
    step the gradients, every ``period`` steps the parameters with the step proof."""
    from commhooks.algorithms.traffic import Send, Traffic, averaged

    if setting.world == 1:
        return Traffic([()] * setting.steps)
    grad = (Send("allreduce", setting.element_bytes * setting.numel, "grad"),)
    sync = tuple(averaged(setting.numel, setting, "sync", "world"))
    at = [t for t in range(1, setting.steps + 1) if t % config.period == 0]
    return Traffic([grad + (sync if t % config.period == 0 else ()) for t in range(1, setting.steps + 1)],
                   grad, sync, at)


commhooks.register_algorithm(MeanEveryStepConfig, MeanEveryStepState, traffic=mean_every_step_traffic)
TOY = {"type": "mean-every-step", "period": 3, "check_every": 1}
