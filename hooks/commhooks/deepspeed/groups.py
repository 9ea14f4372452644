"""Replica groups handed to DeepSpeed as its ``mpu``: the engine's data parallelism runs inside each group.

``deepspeed.initialize(mpu=...)`` takes the data-parallel group from an object with
``get_data_parallel_group()`` and friends (the interface Megatron's ``mpu`` defines), so everything DeepSpeed
does every step (gradient allreduce or reduce-scatter, ZeRO's optimizer-state shards, the fp16 loss scaler's
overflow check) stays inside the replica group, on the fast links; the algorithm syncs across groups.

Model parallelism is not used, but DeepSpeed still reduces over the model-parallel group whenever an ``mpu`` is
given (gradient norms for clipping, overflow flags: ``deepspeed/runtime/utils.py`` all-reduces over
``mpu.get_model_parallel_group()`` with no size check), so that group must be a real process group holding this
rank alone.  With ``group_size`` 1 the data-parallel group is that group, one serving both roles.  Each rank makes
its own (:func:`own_group`), without every rank making every rank's group:

* a default group bound to a device (NCCL initialised eagerly, ``init_process_group(device_id=...)``): one
  ``torch.distributed.split_group`` with one split per rank, entered once by every rank (torch makes subgroups of
  a bound group by ``ncclCommSplit``, which every rank must enter, so a member-only ``new_group`` would hang);
* otherwise (gloo; NCCL initialised lazily): ``new_group([rank], use_local_synchronization=True)``, which only
  this rank enters: no collective at all.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .. import registry
from ..algorithms import replicas


class ReplicaGroups:
    """An ``mpu`` for ``deepspeed.initialize``: the data-parallel group is this rank's replica group.

    Model parallelism is not used: the model-parallel group is the rank alone.  Built collectively
    (every rank creates every replica group, in the same order); :meth:`for_config` builds the one for a hook
    config.
    """

    def __init__(self, groups: List[Tuple[int, ...]]):
        import torch.distributed as dist

        rank = dist.get_rank()
        self.groups = groups
        self.ranks = groups[replicas.group_of(groups, rank)]
        if all(len(g) == 1 for g in groups):  # each rank its own replica: one group of the rank alone, both roles
            self._dp = self._mp = own_group(rank, dist.get_world_size())
        else:
            handles = [dist.new_group(list(g)) for g in groups]  # collective: every rank makes every group
            self._dp = handles[replicas.group_of(groups, rank)]
            self._mp = own_group(rank, dist.get_world_size())  # DeepSpeed needs the rank alone (module docstring)
        self._rank = rank

    @classmethod
    def for_config(cls, conf, world_size: int, local_world_size: Optional[int]) -> Optional["ReplicaGroups"]:
        """The mpu for hook config ``conf``, or None when the algorithm reduces gradients itself."""
        state_class = registry.for_config(conf).state_class
        groups = state_class.data_parallel_groups(conf, world_size, local_world_size)
        return None if groups is None else cls(groups)

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self) -> int:
        return self.ranks.index(self._rank)

    def get_data_parallel_world_size(self) -> int:
        return len(self.ranks)

    def get_data_parallel_group_ranks(self) -> List[int]:
        return list(self.ranks)

    def get_model_parallel_group(self):
        return self._mp

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._rank


def own_group(rank: int, world_size: int):
    """A process group of this rank alone, made without each rank making every rank's (see the module docstring).

    Every rank calls it at the same point: under a device-bound default group it is one communicator split that
    all enter; otherwise only this rank takes part."""
    import torch.distributed as dist

    if getattr(dist.group.WORLD, "bound_device_id", None) is not None:  # eager NCCL: subgroups are splits
        return dist.split_group(split_ranks=[[r] for r in range(world_size)], group_desc="commhooks_own_rank")
    return dist.new_group([rank], use_local_synchronization=True, group_desc="commhooks_own_rank")
