"""Uneven inputs under torch's ``Join``: a rank out of data shadows the others' steps, so the collectives pair up.

The state is a ``torch.distributed.algorithms.join`` joinable (``join_hook``, ``join_device``,
``join_process_group``).  In ``with Join([ddp_model, state]):`` a rank that ran out of data shadows each remaining
iteration of the others (:meth:`ShadowJoinHook.main_hook`): it counts the step, takes part in the syncs and phase
switches (and in the reduction of the strays, with zeros), and agrees on lr-dependent periods (the max over ranks,
to which a joined rank contributes 0).  At the end of the context (:meth:`ShadowJoinHook.post_hook`) the open round
is synced if some rank ran out early; a per-epoch ``with ddp_model.join():`` on even shards ends with one flag
allreduce and no sync.
"""

from __future__ import annotations

from .checks import anywhere


class Joinable:
    """torch's Joinable protocol for a state (a mixin of :class:`~.state.AlgorithmState`):
    ``with Join([ddp_model, state]):`` lets ranks with fewer batches shadow the others."""

    joined = property(lambda self: self.alignment.joined, lambda self, v: setattr(self.alignment, "joined", v),
                      doc="True while this rank shadows the others inside a Join context.")
    _join_config = property(lambda self: self.alignment.join_config,  # the name torch's Join sets on a joinable
                            lambda self, v: setattr(self.alignment, "join_config", v))

    def join_hook(self, **kwargs) -> "ShadowJoinHook":
        """torch's Joinable protocol: ``with Join([ddp_model, state]):`` (ranks with fewer batches shadow)."""
        return ShadowJoinHook(self)

    def end_join(self) -> None:
        """The end of a Join context (every rank), for an engine whose own Join hook must run after it (DDP's)."""
        end_join(self)

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return self.comm.world.handle


class ShadowJoinHook:
    """What a joined rank runs for each iteration the others still train (torch's ``JoinHook`` interface)."""

    def __init__(self, state):
        self.state = state

    def main_hook(self) -> None:
        shadow_step(self.state)

    def post_hook(self, is_last_joiner: bool) -> None:
        if self.state.join_ended_by_engine:  # the engine's hook ended it first (DDP: before its broadcast)
            self.state.join_ended_by_engine = False
            return
        self.state.end_join()


def shadow_step(state) -> None:
    """One iteration of the others on a rank out of data: no update, but every collective of the step."""
    steps = state.alignment
    steps.joined = True
    if state.reduces_gradients and steps.reduced:  # the engine shadowed its own reduction: the strays too
        steps.reduce_strays(shadow=True)
    state.before_step()
    state.end_step()


def end_join(state) -> None:
    """At the end of a Join context (every rank): sync the open round if some rank ran out of data early."""
    steps = state.alignment
    joined = anywhere(state.comm, steps.joined, tag="join")
    steps.joined = False
    if joined:
        state.final_sync()
    state.note_the_end()
