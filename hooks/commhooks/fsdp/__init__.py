"""PyTorch FSDP2 adapter: an algorithm across the replica groups of a ``fully_shard`` model.

A model too large for one GPU is sharded inside a node (or a fast island) by FSDP2 and replicated across the
slow links between them: HSDP.  FSDP2's own HSDP (``fully_shard`` over a 2-D ``(replicate, shard)`` mesh)
all-reduces every gradient across the replicas at every step: exactly the traffic a local method saves.  So
here FSDP2 shards over the *shard* dimension only, and commhooks owns the other one:

* inside a replica group, FSDP2 is unchanged: it all-gathers the parameters for forward and backward and
  reduce-scatters the gradients, so the group keeps one model, averaged every step;
* across the groups, commhooks syncs each rank's local shards with the same shards of the other groups
  (rank ``i`` of every group: ``mesh["replicate"]``), on the algorithm's schedule.  A step that does not sync
  sends nothing across groups.

Usage, after ``fully_shard`` and the optimizer::

    mesh = commhooks.fsdp.replica_mesh(group_size=8)        # (replicate, shard); group_size: ranks per replica
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    state = commhooks.fsdp.register(model, optimizer, "configs/qsr_gpt.json")

The route, and why (what FSDP2 offers and what it does not): FSDP2 has no comm-hook API for the gradients
of a local step (``set_requires_all_reduce(False)`` defers the reduction for gradient accumulation: the
gradient is withheld until a step that reduces, so it cannot make steps local), and ``set_all_reduce_hook``
(torchtitan's fault-tolerant HSDP) runs after an all-reduce that is still there every step.  A parameter of a
``fully_shard`` model is a DTensor whose local part is this rank's shard, updated in place by the optimizer
and read by FSDP2's next all-gather; torchft's DiLoCo syncs exactly these local parts.  The state is handed
the local parts as its tensors (``EngineFacts(replica_data_parallel=True)``: the engine averages inside the
group, the state syncs shards across groups, as with DeepSpeed's ZeRO partitions) and the map from each to
its DTensor, where its gradient and optimizer state are (``master_slices``).  Anchors, outer momentum and
residuals are therefore kept for the shard only: ``1 / group_size`` of the model per rank.

What is refused, on every rank alike: a model that is not ``fully_shard``-ed, or has parameters no
``fully_shard`` call manages (their gradients would not be averaged inside the group); FSDP2's own HSDP
(a 2-D mesh: it would send every step anyway); shard groups that are not blocks of consecutive ranks; a
``group_size`` in the config other than the shard group's; an algorithm that needs whole tensors on every
rank (its state's ``engine_data_parallel`` is False: a rank here holds rows of each weight).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist

from .. import facts, registry
from ..config import ConfigError, load_config
from .checkpoint import load_checkpoint, save_checkpoint
from .model import local_shards, shard_group

__all__ = ["load_checkpoint", "register", "replica_mesh", "save_checkpoint"]


def replica_mesh(group_size: int, device_type: Optional[str] = None):
    """The 2-D device mesh ``(replicate, shard)`` of the world: replica groups of ``group_size`` consecutive
    ranks (a node's GPUs when ``group_size`` is the ranks per node).  Shard with ``fully_shard(module,
    mesh=mesh["shard"])``; ``mesh["replicate"]`` is where commhooks syncs.  ``device_type``: ``"cuda"`` when a
    GPU is there, else ``"cpu"`` (gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if not isinstance(group_size, int) or group_size < 1 or world % group_size:
        raise ConfigError(f"commhooks.fsdp.replica_mesh: group_size must divide the {world} ranks, got {group_size!r}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (world // group_size, group_size), mesh_dim_names=("replicate", "shard"))


def register(model, optimizer, config, process_group=None, scaler=None, **state_options):
    """Build the state for ``config`` across the replica groups of a ``fully_shard`` model; return it.

    ``model``: the root module ``fully_shard`` was applied to, sharded over one shard group of consecutive
    ranks (``replica_mesh(group_size)["shard"]``).  ``config``: a config object, dict or JSON path; its
    ``group_size`` may be left out (it is the shard group's) or must equal it.  ``optimizer``, ``scaler``,
    ``state_options``: as :func:`commhooks.ddp.register`.  Collective: every rank calls it at the same point.
    """
    conf = load_config(config)
    if conf is None:
        raise ConfigError("commhooks.fsdp.register: {'type': 'none'} is FSDP2's own HSDP: shard over the 2-D mesh "
                          "(fully_shard(module, mesh=mesh)) and register nothing")
    algorithm = registry.for_config(conf)
    algorithm.check_options(state_options, "commhooks.fsdp.register")
    if not algorithm.state_class.engine_data_parallel:
        able = [a.name for a in registry.algorithms() if a.state_class.engine_data_parallel]
        raise ConfigError(
            f"commhooks.fsdp: {conf.kind!r} needs whole tensors on every rank (its state does not declare "
            "engine_data_parallel), and a rank of a fully_shard model holds a shard of each (the docs' FSDP page "
            f"says why for each algorithm); algorithms that sync shards: {', '.join(map(repr, able))}")
    size = len(shard_group(model))
    given = getattr(conf, "group_size", None) if "group_size" in conf.model_fields_set else None
    if given is None:  # left out (or null): the replica group is the shard group
        conf = conf.model_copy(update={"group_size": size})
    elif given != size:
        raise ConfigError(f"{conf.kind}.group_size {given} must be the shard group's {size} ranks (the model is "
                          f"sharded over {size}); leave group_size out or set {size}")
    world = dist.get_world_size(process_group)
    if size == world:  # every rank on every rank the same verdict: a warning, so a one-group try run still runs
        warnings.warn(
            f"commhooks.fsdp: the model is sharded over all {world} ranks (FSDP2's default 1-D mesh), one replica "
            f"group: {conf.kind} has no other group to sync with and sends nothing. To sync replica groups, shard "
            f"over a (replicate, shard) mesh: mesh = commhooks.fsdp.replica_mesh(group_size=K) with K dividing "
            f"{world}, then fully_shard(module, mesh=mesh['shard'])", UserWarning, stacklevel=2)
    named, slices = local_shards(model)
    engine = facts.for_model(model, replica_data_parallel=True, master_slices=slices)
    state = algorithm.state_class(optimizer=optimizer, named_parameters=named, engine=engine,
                                  process_group=process_group, config=conf, **state_options)
    if scaler is not None:
        state.use_scaler(scaler)
    return state
