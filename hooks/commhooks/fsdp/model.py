"""What commhooks reads off a ``fully_shard`` model: the shard group it is sharded over (checked), and each
trainable parameter's local shard with the DTensor it belongs to."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ..config import ConfigError


def shard_group(model: torch.nn.Module) -> Tuple[int, ...]:
    """The ranks FSDP2 shards ``model`` over (one mesh for every parameter); ConfigError on what cannot work."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError as exc:  # torch without FSDP2
        raise ConfigError(f"commhooks.fsdp needs torch's FSDP2 (torch.distributed.fsdp.fully_shard): {exc}") from None
    if not isinstance(model, FSDPModule):
        raise ConfigError(f"commhooks.fsdp.register needs the module fully_shard was applied to last (the root), got "
                          f"{type(model).__name__}: call fully_shard(model, mesh=mesh['shard']) after its blocks")
    plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if plain:
        raise ConfigError(f"commhooks.fsdp: parameters no fully_shard call manages: {plain[:4]}"
                          f"{' ...' if len(plain) > 4 else ''} (FSDP2 would not average their gradients inside the "
                          "replica group); apply fully_shard to the root module too")
    meshes = {(tuple(p.device_mesh.mesh.shape), tuple(p.device_mesh.mesh.flatten().tolist())): p.device_mesh
              for _, p in model.named_parameters()}
    if len(meshes) != 1:
        raise ConfigError(f"commhooks.fsdp: the parameters are sharded over {len(meshes)} different meshes; "
                          "shard every block over the same mesh['shard']")
    (_, ranks), mesh = next(iter(meshes.items()))
    if mesh.ndim != 1:
        raise ConfigError(
            f"commhooks.fsdp: the model is sharded over a {mesh.ndim}-D mesh {mesh.mesh_dim_names}: that is FSDP2's "
            "own HSDP, which all-reduces every gradient across the replicas at every step (the traffic a local "
            "method saves).  Shard over the shard dimension only: fully_shard(module, mesh=mesh['shard']), with "
            "mesh = commhooks.fsdp.replica_mesh(group_size)")
    size, rank = len(ranks), dist.get_rank()
    first = rank - rank % size
    if ranks != tuple(range(first, first + size)):
        raise ConfigError(f"commhooks.fsdp: rank {rank} is sharded over ranks {list(ranks)}; replica groups are "
                          f"blocks of consecutive ranks ({list(range(first, first + size))} here): build the mesh "
                          "with commhooks.fsdp.replica_mesh(group_size) or init_device_mesh(..., (replicas, "
                          "group_size), mesh_dim_names=('replicate', 'shard'))")
    return ranks


def local_shards(model: torch.nn.Module) -> Tuple[List[Tuple[str, torch.Tensor]], Dict[int, tuple]]:
    """The trainable parameters' local parts by name, and the map from each to its DTensor (``master_slices``:
    the part is all of the DTensor's local elements).  The parts share their storage with the parameters: the
    optimizer's in-place update and FSDP2's next all-gather both see a sync's writes."""
    named, slices = [], {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                local = p.to_local()
                named.append((name, local))
                slices[id(local)] = (p, 0, local.numel())
    return named, slices


