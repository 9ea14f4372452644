"""Names a state offered before its sync code was handed a :class:`~.steps.SyncContext` (2026-12-06): they still
work, with a DeprecationWarning naming the new spelling, so an algorithm written outside the package keeps
running while its author moves to ``self.sync_context``."""

from __future__ import annotations

import warnings


def _moved(old: str, new: str) -> None:
    warnings.warn(f"state.{old} is deprecated: use state.{new}", DeprecationWarning, stacklevel=3)


class DeprecatedNames:
    """A mixin of :class:`~.state.AlgorithmState`: the old spellings, forwarded."""

    def step_proof(self):
        _moved("step_proof()", "sync_context.proof()")
        return self.sync_context.proof()

    def check_proof(self, mean, group, tag: str, step=None) -> None:
        _moved("check_proof()", "sync_context.check()")
        self.sync_context.check(mean, group, tag, step)

    def collective_context(self):
        _moved("collective_context()", "sync_context.failures()")
        return self.sync_context.failures()

    def rounding_seed(self) -> int:
        _moved("rounding_seed()", "sync_context.rounding_seed()")
        return self.sync_context.rounding_seed()

    def tensors_changed(self) -> None:
        _moved("tensors_changed()", "sync_context.changed()")
        self.sync_context.changed()

    @property
    def scaler(self):
        _moved("scaler", "alignment.scaler")
        return self.alignment.scaler
