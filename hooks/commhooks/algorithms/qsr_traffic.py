"""QSR's traffic declaration: the calls :class:`~commhooks.algorithms.qsr.QSRState` makes, step by step.

Registered with the algorithm (``register_algorithm(QSRConfig, QSRState, traffic=...)``); the meter tests,
``commhooks plan`` and the docs read QSR's bytes from here.  Per rank, with ``N`` parameter elements:

* every step, with replica groups of ``g >= 2`` ranks (unless the engine averages inside them): the group's
  gradient mean, ``4 N`` (``group-grad``, scope ``group``);
* a sync, plain averaging: the parameters (``hierarchical``: this rank's ``1/g`` part, ``across``) with the
  step proof, buffers and optimizer moments in the same call (``sync``); hierarchical: the part shared in the
  group afterwards (``share-part``, a broadcast of ``4 x part``);
* a sync, outer step (``outer_lr``, ``outer_momentum``, ``payload``, ``overlap_steps``, ``fragments``): each
  fragment's pseudo-gradient with its own step proof, fp32 by allreduce, any other codec by allgather of
  ``proof + codec.nbytes(fragment)`` or by the two-step exchange (an all-to-all when sent, an allgather when it
  lands: :func:`~commhooks.algorithms.traffic.body_sends`) (``sync``, ``sync-f<k>``); buffers (``sync-buffers``) and moments
  (``sync-moments``) each with a proof; unless every rank starts from the same weights (``setting.same_start``:
  DDP and Horovod's ``broadcast_parameters`` see to it), the anchor once at the first step (``anchor``, ``4 x`` the synced
  elements); hierarchical: each landed fragment shared in the group.

The schedule (the rule's periods from ``setting.lr``; fragments' send points, overlapped syncs landing
``overlap_steps`` later and the last round's blocking sync of every fragment, from the state's own
:class:`~commhooks.algorithms.pipeline.RoundSchedule`) is simulated as the state runs it.
"""

from __future__ import annotations

from typing import Dict, List

from . import replicas
from .pipeline import RoundSchedule
from .traffic import Send, Setting, Traffic, averaged, body_sends, runs


def qsr_traffic(config, setting: Setting) -> Traffic:
    """The traffic of ``config`` (a validated ``QSRConfig``) for one rank in ``setting``."""
    from .qsr import qsr_period

    c, s = config, setting
    size = replicas.resolve_size(c.group_size, s.world, s.local_world)
    groups = replicas.contiguous_groups(size, s.world, "qsr.group_size")
    mine = groups[replicas.group_of(groups, s.rank)]
    n = s.numel
    engine_dp = s.engine_data_parallel and len(mine) > 1
    hierarchical = c.hierarchical and len(mine) > 1 and not engine_dp
    sharded = hierarchical or engine_dp  # a rank syncs its part with the same part of the other groups
    part = runs(n, len(mine))[mine.index(s.rank)] if sharded else n
    scope = "across" if sharded else "world"
    buffers = s.buffers if c.average_buffers else 0
    moments = s.moments if c.average_optimizer_state else 0
    every_step = (Send("allreduce", s.element_bytes * n, "group-grad", "group"),) if (
        len(mine) > 1 and not engine_dp) else ()

    def share(numel: int) -> List[Send]:
        return [Send("broadcast", 4 * numel, "share-part", "group")] if hierarchical else []

    timeline: List[List[Send]] = [list(every_step) for _ in range(s.steps)]
    sync_steps: List[int] = []

    def after_sync_extras() -> List[Send]:
        out = []
        if buffers:
            out += averaged(buffers, s, "sync-buffers", "world")
        if moments:
            out += averaged(moments, s, "sync-moments", scope)
        return out

    if not c.pseudo_gradient:
        if sharded:  # parameters' part (+ moments, whole) across, shared in the group, buffers over the world
            sync = averaged(part + moments, s, "sync", scope) + share(part) + (
                averaged(buffers, s, "sync-buffers", "world") if buffers else [])
        else:
            sync = averaged(n + buffers + moments, s, "sync", scope)
        h, since = None, 0
        for t in range(s.steps):
            if h is None:
                h = qsr_period(t, s.lr(t), c)
            since += 1
            if since >= h:
                timeline[t] += sync
                sync_steps.append(t + 1)
                h, since = None, 0
    else:
        frags = runs(part, c.fragments)
        codec = c.codec
        tags = ["sync"] if c.fragments == 1 else [f"sync-f{k}" for k in range(c.fragments)]
        schedule = RoundSchedule(c)
        in_flight: Dict[int, int] = {}  # fragment -> step it lands at
        exchange_size = len(groups) if sharded else s.world
        body = [body_sends(codec, f, s.proof_bytes, tag, scope, exchange_size) for f, tag in zip(frags, tags)]

        def land(k: int, t: int) -> None:
            in_flight.pop(k)
            timeline[t] += body[k][1] + share(frags[k])

        def send(k: int, t: int, step: int, blocking: bool) -> None:
            if k in in_flight:
                land(k, t)
            apply_at = schedule.lands_at(step, blocking)
            timeline[t] += body[k][0]
            in_flight[k] = apply_at
            if apply_at <= step:
                land(k, t)

        sync = [x for sent, landed in body for x in sent + landed]
        sync += [x for f in frags for x in share(f)] + after_sync_extras()
        h, since = None, 0
        for t in range(s.steps):
            step = t + 1
            if t == 0 and (engine_dp or not s.same_start):  # the anchor: the group's mean of what this rank syncs,
                # fragment by fragment (ranks that start equal keep their own; a ZeRO shard is never the same)
                timeline[t] += [Send("allreduce", 4 * f, "anchor", scope) for f in frags] + share(part)
            if h is None:
                h = qsr_period(t, s.lr(t), c)
            since += 1
            for k in sorted(k for k, at in in_flight.items() if at <= step):
                land(k, t)
            if since >= h:
                blocking = schedule.ends_run(step)
                if blocking:
                    for k in sorted(in_flight):
                        land(k, t)
                due = range(c.fragments) if blocking else schedule.sends(h, h)
                for k in due:
                    send(k, t, step, blocking)
                timeline[t] += after_sync_extras()
                sync_steps.append(step)
                h, since = None, 0
            else:
                for k in schedule.sends(since, h):
                    send(k, t, step, False)
    size_of = {"world": s.world, "group": len(mine), "across": len(groups)}
    kept = lambda calls: tuple(x for x in calls if size_of[x.scope] > 1)  # noqa: E731  (groups of one: no call)
    return Traffic([kept(calls) for calls in timeline], kept(every_step), kept(sync), sync_steps, group=len(mine))
