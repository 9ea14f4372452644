"""The one place commhooks touches DeepSpeed's internals: attributes and behaviours of its engine and optimizer
wrappers that DeepSpeed does not document as API.

Checked on DeepSpeed 0.19.8 (with torch 2.13, CPU / gloo, 2 and 4 ranks): fp32, bf16 and fp16 at ZeRO stage 0,
1 and 2, with torch optimizers and DeepSpeed's fused ``"Adam"`` / ``"AdamW"``; the suite's DeepSpeed tests
(``tests/test_deepspeed.py``, ``tests/test_frameworks.py``) exercise every function here.  A DeepSpeed
release that renames one of these breaks this module only: the rest of the adapter uses the engine's public
methods (``step``, ``zero_optimization_stage()``, ``fp16_enabled()``, ``bfloat16_enabled()``,
``is_gradient_accumulation_boundary()``, ``save_checkpoint`` / ``load_checkpoint``) and attributes
(``module``, ``optimizer``, ``dp_world_size``, ``global_steps``) and the documented ``mpu`` interface.

Why internals at all: DeepSpeed has no comm-hook API.  A sync must act on the fp32 *master* weights its
mixed-precision and ZeRO wrappers keep (where they are depends on the wrapper), refresh the low-precision
weights from them, count steps its fp16/bf16 overflow check skips, and stop the engine's own gradient
allreduce when the algorithm reduces gradients itself.
"""

from __future__ import annotations

from typing import Mapping, Tuple

import torch

from ..config import ConfigError

CHECKED_ON = ("0.19.8",)  # DeepSpeed versions this module was checked on


def config_of(engine) -> Mapping:
    """The engine's config as the user wrote it (``engine.config``: DeepSpeed keeps unknown top-level sections
    there, the ``"comm_hook"`` one included); empty if it is not a mapping."""
    config = getattr(engine, "config", None)
    return config if isinstance(config, Mapping) else {}


def inner_optimizer(engine) -> torch.optim.Optimizer:
    """The optimizer the user's parameters (or DeepSpeed's masters) are stepped by (``basic_optimizer``)."""
    return engine.basic_optimizer


def wraps_optimizer(engine) -> bool:
    """Whether DeepSpeed wraps the inner optimizer (fp16/bf16, ZeRO): its wrappers step the inner one once per
    param group, or not at all on an overflow, so the adapter, not the optimizer's step hooks, counts steps."""
    return engine.optimizer is not engine.basic_optimizer


def skipped_steps(engine) -> int:
    """Optimizer steps DeepSpeed skipped so far (fp16 / bf16 overflow)."""
    return engine.skipped_steps


def stop_backward_allreduce(engine) -> None:
    """The engine then only accumulates gradients locally (as its own compressed optimizers do)."""
    engine.enable_backward_allreduce = False


def data_parallel_ranks(engine) -> Tuple[int, ...]:
    """The global ranks of the engine's data-parallel group (empty if it has none of its own)."""
    import torch.distributed as dist

    group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
    return tuple(dist.get_process_group_ranks(group)) if group is not None else ()


def is_map_style(engine, dataset) -> bool:
    """Whether DeepSpeed's loader can take a sampler for ``dataset`` (an iterable dataset cannot)."""
    return engine.is_map_style_dataset(dataset)


def training_loader(engine, dataset=None, sampler=None):
    """The loader DeepSpeed built from ``training_data``; with ``dataset`` and ``sampler``, first rebuilt with
    that sampler (DeepSpeed's own construction, so micro-batch size and collation stay its)."""
    if dataset is not None:
        engine.training_dataloader = engine.deepspeed_io(dataset, data_sampler=sampler)
    return engine.training_dataloader


def masters(engine):
    """(named master tensors, the module parameter of each or None, refresh, slices) for the engine's optimizer.

    fp32 at ZeRO 0: the module's own parameters, nothing to refresh.  DeepSpeed's fp16/bf16 optimizer at
    ZeRO 0: one fp32 copy per parameter (same shape), refreshed by copying.  Its fused variant (DeepSpeed's
    ``"Adam"``/``"AdamW"``: FusedAdam inside ``FP16_Optimizer``) keeps one flat fp32 master per param group:
    handed over as one view per parameter (its shape, its name), so per-layer algorithms see each layer's
    matrix, with ``slices`` mapping each view to its stretch of the flat master (whose optimizer state is
    one).  ZeRO 1/2 and the BF16 optimizer: this rank's flat fp32 partition per param group, refreshed by
    DeepSpeed's ``update_lp_params`` (copy into the low-precision partition, all-gather inside the
    data-parallel group).  ZeRO-3: this rank's flat fp32 partition per sub-group, refreshed as the stage-3
    wrapper does after its update (copy into the parameters' partitions, gather the persistent ones again).
    """
    wrapper, inner = engine.optimizer, engine.basic_optimizer
    if wrapper is inner:
        return list(engine.module.named_parameters()), None, None, None
    if hasattr(wrapper, "fp32_groups") and hasattr(wrapper, "fp16_groups"):  # fp16/bf16 at ZeRO 0
        name_of = {id(p): n for n, p in engine.module.named_parameters()}
        named, lows = [], []
        for i, (highs, lowgroup) in enumerate(zip(wrapper.fp32_groups, wrapper.fp16_groups)):
            for j, (hi, lo) in enumerate(zip(highs, lowgroup)):
                named.append((name_of.get(id(lo), f"group{i}.param{j}"), hi))
                lows.append(lo)

        @torch.no_grad()
        def refresh():
            for (_, hi), lo in zip(named, lows):
                lo.copy_(hi)

        return named, lows, refresh, None
    if hasattr(wrapper, "fp32_groups_flat") and hasattr(wrapper, "fp16_groups"):  # fused: one flat master per group
        name_of = {id(p): n for n, p in engine.module.named_parameters()}
        named, lows, slices = [], [], {}
        for i, (flat, group) in enumerate(zip(wrapper.fp32_groups_flat, wrapper.fp16_groups)):
            offset = 0
            for j, lo in enumerate(group):
                view = flat.detach().view(-1)[offset: offset + lo.numel()].view_as(lo)  # shares the flat's storage
                named.append((name_of.get(id(lo), f"group{i}.param{j}"), view))
                lows.append(lo)
                slices[id(view)] = (flat, offset, offset + lo.numel())
                offset += lo.numel()

        @torch.no_grad()
        def refresh_flat():  # what FP16_Optimizer.step does after its update
            for (_, hi), lo in zip(named, lows):
                lo.data.copy_(hi)

        return named, lows, refresh_flat, slices
    if hasattr(wrapper, "fp32_partitioned_groups_flat"):  # ZeRO-3
        named, slices = zero3_partitions(engine, wrapper)

        @torch.no_grad()
        def refresh_zero3():  # what the stage-3 wrapper does after its update (no offload: refused before)
            for i in range(len(wrapper.fp32_partitioned_groups_flat)):
                wrapper._reassign_or_swap_out_partitioned_parameters(i)  # fp32 -> the parameters' partitions
            persistent = wrapper.persistent_parameters  # small parameters stay gathered: their stale whole copies
            if persistent:                              # are dropped (not written back) and gathered again
                persistent[0].partition(persistent, has_been_updated=False)
                persistent[0].all_gather(persistent)
            wrapper.invalidate_secondary_tensor()

        return named, None, refresh_zero3, slices
    if hasattr(wrapper, "update_lp_params"):  # ZeRO 1/2, BF16_Optimizer: flat partitions
        named = [(f"partition.group{i}.{j}", p) for i, g in enumerate(inner.param_groups) for j, p in enumerate(g["params"])]
        return named, None, wrapper.update_lp_params, None
    raise ConfigError(f"comm_hook does not know DeepSpeed's optimizer {type(wrapper).__name__} (its fp32 master "
                      "weights are where a sync must act); use fp32, bf16 or fp16 at ZeRO stage 0 to 3")


def zero3_partitions(engine, wrapper):
    """ZeRO-3's fp32 masters as one view per parameter: this rank's part of it, without the padding.

    The stage-3 wrapper keeps one flat fp32 partition per sub-group (the inner optimizer's param groups are
    empty between steps: it hands them over one at a time), each the concatenation of its parameters'
    partitions, each padded to the same size on every rank of the group.  The padding is never written (the
    last rank's is whatever memory held), so a fingerprint of whole flats would differ where the weights do
    not; the views hold the parameter's elements only, named as the module names them, and ``slices`` maps
    each to its stretch of the flat (whose optimizer state is one)."""
    import torch.distributed as dist

    name_of = {id(p): n for n, p in engine.module.named_parameters()}
    member = dist.get_rank(group=wrapper.dp_process_group)
    named, slices = [], {}
    for i, (flat, low, params) in enumerate(zip(wrapper.fp32_partitioned_groups_flat,
                                                 wrapper.fp16_partitioned_groups_flat, wrapper.fp16_groups)):
        for j, p in enumerate(params):
            start = (p.ds_tensor.data_ptr() - low.data_ptr()) // low.element_size()
            size = p.ds_tensor.ds_numel
            valid = max(0, min(size, p.ds_numel - member * size))
            view = flat.detach().view(-1)[start: start + valid]
            named.append((name_of.get(id(p), f"subgroup{i}.param{j}"), view))
            slices[id(view)] = (flat, start, start + valid)
    return named, slices


def may_skip_steps(engine) -> bool:
    """Whether DeepSpeed may skip an optimizer step (and its lr-scheduler step) on an overflow: fp16's loss
    scaler, and bf16 with ``check_grad_overflow`` (DeepSpeed's default)."""
    if engine.fp16_enabled():
        return True
    bf16 = getattr(getattr(engine, "_config", None), "bfloat16_config", None)
    return engine.bfloat16_enabled() and bool(getattr(bf16, "check_grad_overflow", True))


def comm_backend():
    """DeepSpeed's communication backend object (``deepspeed.comm.comm.cdb``) if DeepSpeed's comm is loaded, else
    None: its ``reduce_scatter_function`` / ``all_gather_function`` bypass ``torch.distributed``'s module-level
    functions, so the benchmark's collective counter wraps them there (imports nothing)."""
    import sys

    return getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
