"""What a QSR state keeps: its memory, by kind, and its checkpoint (exact resume, syncs in flight included).

Read by the state's ``memory()`` / ``report()`` and ``state_dict()`` / ``load_state_dict()``; the sync itself is
:mod:`.sync`'s.  The checkpoint format: ``{"outers": [per fragment: anchor, buffer (outer momentum), residual,
owner_residual, optimizer], "in_flight": {fragment: sent_at, apply_at, scale, sent_from, mean, proofs}}``; a plain
mean keeps nothing (``None``).
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch

from ...comm import Work
from ..contract import STEP_PROOF_BYTES
from ...payload import OwnerFeedback
from .sync import FragmentSync, InFlight, SyncDriver


def fragment_memory(f: FragmentSync) -> Dict[str, int]:
    """Bytes one fragment's state keeps, by kind: anchor, momentum, residual, outer optimizer, reused buffers."""
    held = {"anchor": f.anchor, "outer_momentum": f.buffer, "residual": f.residual,
            "owner_residual": f.owner_feedback.value}
    out = {k: v.numel() * v.element_size() for k, v in held.items() if v is not None}
    if f.optimizer is not None:
        kept = sum(v.numel() * v.element_size() for st in f.optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.numel() > 1)
        if kept:
            out["outer_optimizer"] = kept
    scratch = sum(b.numel() * b.element_size() for b in f.buffers.values())
    if scratch:
        out["sync_buffers"] = scratch
    return out


def memory(driver: SyncDriver, group_size: int) -> Dict[str, int]:
    """Per fragment, :func:`fragment_memory`; and, for a compressed payload in flight, the gathered payloads of
    the group (size x payload bytes) and the mean."""
    out: Dict[str, int] = {}
    for f in driver.fragments:
        for kind, n in fragment_memory(f).items():
            out[kind] = out.get(kind, 0) + n
    flying = driver.in_flight
    if driver.fragments and driver.fragments[0].codec.name != "fp32" and flying:
        codec = driver.fragments[0].codec
        two_step = codec.exchange_for(group_size)
        held = (lambda n: two_step.received_bytes(n, STEP_PROOF_BYTES)) if two_step is not None else (
            lambda n: group_size * (STEP_PROOF_BYTES + codec.nbytes(n)))
        out["in_flight"] = sum(held(n) + 4 * n for n in (driver.plan.fragment_numels[k] for k in flying))
    return out


def fragment_state(f: FragmentSync) -> dict:
    """Copies: the live tensors change in place at the next sync."""
    state = {k: None if v is None else v.clone() for k, v in
             (("anchor", f.anchor), ("buffer", f.buffer), ("residual", f.residual))}
    if f.owner_feedback.value is not None:  # (absent from checkpoints without a two-step exchange)
        state["owner_residual"] = f.owner_feedback.value.clone()
    optimizer = f.optimizer.state_dict() if f.optimizer is not None else f.optimizer_state
    if optimizer is not None:
        state["optimizer"] = copy.deepcopy(optimizer)
    return state


def load_fragment_state(f: FragmentSync, state: dict) -> None:
    f.anchor, f.buffer, f.residual = (None if state[k] is None else state[k].clone()
                                      for k in ("anchor", "buffer", "residual"))
    owned = state.get("owner_residual")
    f.owner_feedback = OwnerFeedback(None if owned is None else owned.clone())
    if state.get("optimizer") is not None and f.make_optimizer is None:
        raise ValueError("the checkpoint's outer step used an outer_optimizer; pass the same outer_optimizer")
    if state.get("buffer") is not None and f.make_optimizer is not None:
        raise ValueError("the checkpoint's outer step is the built-in one with momentum; its momentum would be "
                         "lost under an outer_optimizer: resume without outer_optimizer")
    f.optimizer, f.optimizer_state = None, copy.deepcopy(state.get("optimizer"))  # (torch keeps tensors)
    f.flight = None


def save(driver: SyncDriver) -> Optional[dict]:
    """The outer states and the syncs in flight with their results (waited for: they are in the network).
    Collective in effect: every rank calls it at the same step (checkpoints are).  None for a plain mean."""
    if not driver.plan.outer_step:
        return None
    flights = {}
    flying = [(f.flight.sent_at, k, f) for k, f in enumerate(driver.fragments) if f.flight is not None]
    for _, k, f in sorted(flying, key=lambda x: x[:2]):  # in the order they were sent: waiting may exchange
        mean, proofs = f.flight.work.wait()
        flights[k] = {"sent_at": f.flight.sent_at, "apply_at": f.flight.apply_at, "scale": f.flight.scale,
                      "sent_from": None if f.flight.sent_from is None else f.flight.sent_from.clone(),
                      "mean": mean.clone(), "proofs": proofs.clone()}
    return {"outers": [fragment_state(f) for f in driver.fragments], "in_flight": flights}


def load(driver: SyncDriver, state: Optional[dict]) -> None:
    """Restore :func:`save`'s state; ValueError naming what changed when it does not fit this run."""
    if not driver.plan.outer_step:
        return
    if state is None:
        raise ValueError("it holds no outer-step state (saved by a run with plain averaging?), and this run's "
                         "config takes outer steps (outer_lr / outer_momentum / payload / overlap_steps / "
                         "fragments): resume with the config it was saved with")
    if "outers" not in state:  # saved before fragments existed: one outer state
        state = {"outers": [state], "in_flight": {}}
    if len(state["outers"]) != len(driver.fragments):
        raise ValueError(f"the checkpoint holds {len(state['outers'])} fragments' outer state, this state has "
                         f"{len(driver.fragments)} (qsr.fragments changed?)")
    for k, (f, saved) in enumerate(zip(driver.fragments, state["outers"])):
        anchor, want = saved.get("anchor"), driver.plan.fragment_numels[k]
        if anchor is not None and anchor.numel() != want:
            raise ValueError(f"the checkpoint's anchor of fragment {k} has {anchor.numel()} elements, this rank "
                             f"syncs {want} (the parameters, qsr.hierarchical or the group size changed?)")
        load_fragment_state(f, saved)
    for k, saved in state["in_flight"].items():
        driver.fragments[int(k)].flight = InFlight(
            int(saved["sent_at"]), int(saved["apply_at"]),
            None if saved["sent_from"] is None else saved["sent_from"].clone(),
            Work(lambda r=(saved["mean"].clone(), saved["proofs"].clone()): r), float(saved.get("scale", 1.0)))


class QSRKept:
    """A mixin of :class:`~.state.QSRState`: its checkpoint (the open round, the outer state), memory, report."""

    def algorithm_state_dict(self) -> dict:
        state = {"since_sync": self.round.since, "H": self.round.period, "complete_at": self.complete_at,
                 "lr_sums": list(self.lr_sums)}
        outer = save(self.driver)
        return state if outer is None else {**state, "outer": outer}

    def load_algorithm_state_dict(self, state: dict) -> None:
        load(self.driver, state.get("outer"))
        rnd = self.round  # the open round as saved, its syncs in flight as restored
        rnd.period, rnd.since = None if state["H"] is None else int(state["H"]), int(state["since_sync"])
        rnd.in_flight, rnd.anchored = dict(self.driver.in_flight), self.driver.anchored and self.plan.outer_step
        self.complete_at = state.get("complete_at")
        if self.plan.streaming:  # streamed rounds agree only after a complete sync (a plain round after each)
            self.sync_context.in_sync = self.complete_at
        if len(state.get("lr_sums", ())) == len(self.lr_sums):
            self.lr_sums = [float(v) for v in state["lr_sums"]]

    def status(self) -> str:
        phase = "warm-up" if self.step < self.config.warmup_steps else "rule"
        return f"{phase} | H {self.H if self.H is not None else '-'} ({self.since_sync} since sync)"

    def algorithm_memory(self) -> Dict[str, int]:
        """Per fragment: anchor, outer momentum, error-feedback residual, the reused sync buffers; and, for a
        compressed payload in flight, the gathered payloads of the group (size x payload bytes) and the mean."""
        return memory(self.driver, self.comm.size if self.shards is None else self.shards.size)

    def algorithm_report(self) -> dict:
        gaps = [b - a for a, b in zip([0] + self.sync_steps[:-1], self.sync_steps)]
        return {"H": self.H, "since_sync": self.since_sync,
                "mean_H": round(sum(gaps) / len(gaps), 2) if gaps else None,
                "H_range": [min(gaps), max(gaps)] if gaps else None,
                "sync_fraction": round(self.syncs / self.step, 4) if self.step else None}
