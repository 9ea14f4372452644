"""Replica groups handed to DeepSpeed as its ``mpu``: the engine's data parallelism runs inside each group.

``deepspeed.initialize(mpu=...)`` takes the data-parallel group from an object with
``get_data_parallel_group()`` and friends (the interface Megatron's ``mpu`` defines), so everything DeepSpeed
does every step (gradient allreduce or reduce-scatter, ZeRO's optimizer-state shards, the fp16 loss scaler's
overflow check) stays inside the replica group, on the fast links; the algorithm syncs across groups.

Model parallelism is not used, but DeepSpeed still reduces over the model-parallel group whenever an ``mpu`` is
given (gradient norms for clipping, overflow flags: ``deepspeed/runtime/utils.py`` all-reduces over
``mpu.get_model_parallel_group()`` with no size check), so that group must be a real process group holding this
rank alone.  ``torch.distributed.new_group`` must be entered by every rank for every group, in the same order
(with NCCL and an eagerly initialised default group every rank takes part in the communicator split), so each
rank makes the single-rank group of every rank.  With ``group_size`` 1 the data-parallel groups already are
those single-rank groups, and the same one serves both roles: no second set is made.

Why not ``new_group([rank], use_local_synchronization=True)``, each rank making only its own: with NCCL and a
default group bound to a device (eager initialisation, ``init_process_group(device_id=...)``), torch 2.13 makes a
subgroup by ``ncclCommSplit`` of the default group's communicator, which every rank of the default group must
enter (``_new_process_group_helper`` splits on non-members too); a member-only creation would hang there.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .. import registry
from ..algorithms import replicas


class ReplicaGroups:
    """An ``mpu`` for ``deepspeed.initialize``: the data-parallel group is this rank's replica group.

    Model parallelism is not used: the model-parallel group is the rank alone.  Built collectively
    (every rank creates every group, in the same order); :meth:`for_config` builds the one for a hook config.
    """

    def __init__(self, groups: List[Tuple[int, ...]]):
        import torch.distributed as dist

        rank = dist.get_rank()
        self.groups = groups
        self.ranks = groups[replicas.group_of(groups, rank)]
        handles = [dist.new_group(list(g)) for g in groups]  # collective: every rank makes every group
        self._dp = handles[replicas.group_of(groups, rank)]
        if len(self.ranks) == 1:
            self._mp = self._dp  # the rank alone already (group_size 1)
        else:  # DeepSpeed needs a process group of the rank alone (see the module docstring)
            singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
            self._mp = singles[rank]
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
