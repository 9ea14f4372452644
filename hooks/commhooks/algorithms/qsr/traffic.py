"""QSR's traffic declaration: the calls :class:`~commhooks.algorithms.qsr.QSRState` makes, step by step.

Registered with the algorithm (``register_algorithm(QSRConfig, QSRState, traffic=...)``); the meter tests,
``commhooks plan`` and the docs read QSR's bytes from here.  Per rank, with ``N`` parameter elements:

* every step, with replica groups of ``g >= 2`` ranks (unless the engine averages inside them): the group's
  gradient mean, ``4 N`` (``group-grad``, scope ``group``);
* a sync, plain averaging: the parameters (``hierarchical``: this rank's ``1/g`` part, ``across``) with the step
  proof, buffers and optimizer moments in the same call (``sync``); hierarchical: the part shared in the group
  afterwards (``share-part``, a broadcast of ``4 x part``);
* a sync, outer step (``outer_lr``, ``outer_momentum``, ``payload``, ``overlap_steps``, ``fragments``): each
  fragment's pseudo-gradient with its own step proof, fp32 by allreduce, any other codec by allgather of ``proof +
  codec.nbytes(fragment)`` or by the two-step exchange (an all-to-all when sent, an allgather when it lands:
  :func:`~commhooks.algorithms.traffic.body_sends`) (``sync``, ``sync-f<k>``), an overlapped sync's calls when
  sent marked with the steps they run behind (``Send.behind``: the planner hides them behind those steps'
  compute); buffers (``sync-buffers``) and moments (``sync-moments``) each with a proof; unless every rank starts
  from the same weights (``setting.same_start``: DDP and Horovod's ``broadcast_parameters`` see to it), the anchor
  once at the first step (``anchor``, ``4 x`` the synced elements); hierarchical: each landed fragment shared in
  the group.

The plan (groups, parts, outer step or plain mean, fragment sizes) and the rounds (each step's events: what lands,
what is sent, when a round ends; the anchor) are the state's own: :class:`~.plan.SyncPlan` and
:class:`~.state.Round`, replayed here with the rule's periods from ``setting.lr``.  Nothing here simulates the
schedule a second time: each event is mapped to the calls it makes.
"""

from __future__ import annotations

import dataclasses
from typing import List

from ...facts import row_shard_numel
from ..traffic import Send, Setting, Traffic, averaged, body_sends
from .plan import SyncPlan, runs
from .state import Round


def qsr_traffic(config, setting: Setting) -> Traffic:
    """The traffic of ``config`` (a validated ``QSRConfig``) for one rank in ``setting``."""
    c, s, n = config, setting, setting.numel

    def plan_for(numel: int) -> SyncPlan:
        return SyncPlan.build(c, s.world, s.rank, s.local_world, s.engine_data_parallel, numel, s.outer_optimizer)

    plan = plan_for(n)
    if plan.engine_sharded:  # the engine hands over its shard: an equal run of the replica's parameters (ZeRO),
        # or each parameter's chunk of rows (FSDP2)
        g, m = len(plan.members), plan.member
        plan = plan_for(row_shard_numel([shape for _, shape in s.shapes], g, m) if s.shard_rows else runs(n, g)[m])
    part, scope, mine, frags = plan.part_numel, plan.scope, plan.members, plan.fragment_numels
    buffers = s.buffers if c.average_buffers else 0
    moments = s.moments if c.average_optimizer_state else 0
    every_step = (Send("allreduce", s.element_bytes * n, "group-grad", "group"),) if (
        len(mine) > 1 and not plan.engine_sharded) else ()

    def share(numel: int) -> List[Send]:
        return [Send("broadcast", 4 * numel, "share-part", "group")] if plan.hierarchical else []

    world_buffers = averaged(buffers, s, "sync-buffers", "world") if buffers else []
    if not plan.outer_step:  # one call, landing at once: the parameters' part (+ moments) across, shared in the
        # group, buffers over the world; or everything over the world
        sent = [averaged(part + moments, s, "sync", scope) + share(part) if plan.sharded else
                averaged(n + buffers + moments, s, "sync", scope)]
        landed: List[List[Send]] = [[]]
        ended = world_buffers if plan.sharded else []
        sync = sent[0] + ended
    else:  # per fragment: its payload when sent, the two-step exchange's second half and the share when it lands
        tags = ["sync"] if len(frags) == 1 else [f"sync-f{k}" for k in range(len(frags))]
        size = len(plan.groups) if plan.sharded else s.world
        body = [body_sends(c.codec, f, s.proof_bytes, tag, scope, size) for f, tag in zip(frags, tags)]
        sent = [b[0] for b in body]
        landed = [b[1] + share(f) for b, f in zip(body, frags)]
        ended = world_buffers + (averaged(moments, s, "sync-moments", scope) if moments else [])
        sync = [x for b in body for x in b[0] + b[1]] + [x for f in frags for x in share(f)] + ended
    timeline: List[List[Send]] = [list(every_step) for _ in range(s.steps)]
    sync_steps: List[int] = []
    rnd = Round()
    for t in range(s.steps):
        if rnd.anchor_due(plan.outer_step) and not s.same_start:  # the anchor: the group's mean, fragment by
            # fragment (ranks that start equal keep their own; an engine's shard is compared with its counterparts)
            timeline[t] += [Send("allreduce", 4 * f, "anchor", scope) for f in frags] + share(part)
        if rnd.period is None:
            rnd.begin(t, s.lr(t), c)
        for event in rnd.advance(t + 1, c, plan.streaming):
            if event.kind == "send":  # an overlapped sync runs behind the steps until it lands
                timeline[t] += [dataclasses.replace(x, behind=event.at - (t + 1)) for x in sent[event.fragment]]
            elif event.kind == "land":
                timeline[t] += landed[event.fragment]
            elif event.kind == "end":
                timeline[t] += ended
                sync_steps.append(t + 1)
    size_of = {"world": s.world, "group": len(mine), "across": len(plan.groups)}
    kept = lambda calls: tuple(x for x in calls if size_of[x.scope] > 1)  # noqa: E731  (groups of one: no call)
    return Traffic([kept(calls) for calls in timeline], kept(every_step), kept(sync), sync_steps, group=len(mine))
