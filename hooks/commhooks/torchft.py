"""torchft adapter: replica groups that drop out and heal while the others go on syncing, no restart.

Local methods suit fault tolerance: between syncs the replica groups do not talk, so when one dies the others
need not stop.  torchft provides what that takes: a Lighthouse that forms a *quorum* of the live groups at each
step, a ``Manager`` per rank of each group, and the transport that heals a restarted group from a live one.
commhooks keeps its algorithms, payloads and declarations; its syncs go through the Manager
(:class:`~commhooks.comm.torchft_comm.ManagedComm`).  A replica group is one process, or several under their own
launcher (``torchrun --max-restarts``) with DDP or FSDP2 inside the group: rank i of a group has a Manager with
``rank=i, world_size=<ranks per group>`` and syncs with rank i of the other groups (the whole model under DDP,
its shards under FSDP2, as torchtitan's DiLoCo does)::

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), load_state_dict=None, state_dict=None,
                              min_replica_size=1, use_async_quorum=False, replica_id=f"group{g}",
                              rank=group_rank, world_size=group_size, ...)
    live = commhooks.torchft.register(ddp_model, optimizer, "configs/qsr_mnist1d.json", manager, scheduler)
    while live.state.step < total_steps:          # a healed group goes on from its peers' step
        batch = batch_for(live.state.step)
        ...; optimizer.step(); scheduler.step()
    live.close()

What happens:

* **Register** builds the algorithm's state over the Manager, registers its heal callbacks, and joins: the first
  quorum; in a fresh job (no step committed yet) the groups of that quorum meet once and commit a first step,
  so that torchft's step count, by which it tells who is behind, puts a group that starts later behind every
  live one.  A group that starts late, or again after a crash, is behind: torchft copies a live group's state
  into it here (model, optimizer, scheduler, and the hook's: the outer step's anchor and momentum, the rule's
  position, the step), then the state drops what was the other group's own (its error-feedback residual).
* **A step that communicated** ends with ``should_commit()``; the next quorum, where a waiting group is admitted
  and healed, opens the next optimizer step (the loop has stepped its scheduler by then): with blocking syncs, a
  round's end, and every group starts the next round from the same state, the healed one included.
* **A group lost** shows at the next sync: the collective fails, and the survivors retry it among themselves
  (``start_quorum(shrink_only=True)``), alone if need be (a mean of one): they wait for the Lighthouse to drop
  the lost group (its heartbeat timeout), never for it to come back.  Each collective ends with torchft's vote,
  which the ranks of a group take together, so a group of several ranks retries (or goes on) as one.
* **A rank lost inside a group** takes the group down: its other ranks fail in the group's own collectives (DDP,
  FSDP2) or in the vote, and the group's launcher restarts all of them; the group then joins behind and heals
  (rank i from rank i of a live group), as a group lost whole does.
* **Checks.** A joining group's config, commhooks version and parameter shapes must equal the live group's it
  heals from (torchft's ``init_sync`` heals fresh groups at the first step too): otherwise a ``ConfigError``.

Tuning: the Manager's ``quorum_timeout`` must exceed the longest round (a joining group waits in ``register``
for the others' next sync); the Lighthouse's ``heartbeat_timeout_ms`` is how soon a lost group is dropped (the
survivors retry until then, within the config's ``timeout_s``).  A group's Managers find each other through a
store: under ``torchrun --max-restarts`` give them one made new at each start (``commhooks.launch.fresh_store()``),
since torchrun's own store keeps a dead start's keys (the old Manager's address).  Not supported: algorithms that
average gradients every step (AB; QSR's ``group_size``: the groups are torchft's), the two-step exchange (an
all-to-all; ``payload_exchange: "allgather"`` works).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import facts, registry
from .checkpoint import load_checkpoint
from .checkpointer import Checkpointer, host_copy
from .commit import CheckpointError, complete_folders, read_manifest, step_folder
from .comm.base import CollectiveError
from .comm.torchft_comm import ManagedComm
from ._version import __version__
from .config import ConfigError, load_config
from .fsdp.model import local_shards, shard_group
from .settings import to_dict


class LiveGroups:
    """A state whose syncs go through torchft; heals, retries and commits around the optimizer's steps."""

    def __init__(self, model, optimizer, config, manager, scheduler=None, checkpoint_dir=None, checkpoint_every=0,
                 **state_options):
        config = load_config(config)
        if config is None:
            raise ConfigError("commhooks.torchft.register: config {'type': 'none'} has no syncs to make live")
        if getattr(config, "payload", "fp32") != "fp32" and getattr(config, "payload_exchange", "allgather") != "allgather":
            raise ConfigError(f"commhooks.torchft.register: payload {config.payload!r} with payload_exchange "
                              f"{config.payload_exchange!r}: under torchft set payload_exchange to \"allgather\" (the "
                              "two-step exchange cuts its pieces for a fixed number of groups)")
        if checkpoint_dir is not None and (not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool)
                                           or checkpoint_every < 1):
            raise ValueError(f"commhooks.torchft.register: checkpoint_every must be a number of steps >= 1 with "
                             f"checkpoint_dir, got {checkpoint_every!r}")
        self.manager, self.model, self.scheduler = manager, model, scheduler
        self.optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if getattr(config, "group_size", None) not in (None, 1):
            raise ConfigError(f"commhooks.torchft.register: {config.kind}.group_size {config.group_size}: under torchft "
                              "the replica groups are torchft's (one Manager per rank of each group, the group's own "
                              "DDP or FSDP2 inside it); leave group_size out")
        self.comm = ManagedComm(manager, timeout_s=config.timeout_s)
        algorithm = registry.for_config(config)
        algorithm.check_options(state_options, "commhooks.torchft.register")
        named, engine = _engine(model)
        self.state = algorithm.state_class(optimizer=optimizer, model=model, named_parameters=named, engine=engine,
                                           comm=self.comm, config=config, **state_options)
        if self.state.reduces_gradients:
            self.state.remove()
            raise ConfigError(f"commhooks.torchft.register: this {self.state.display_name} config averages gradients "
                              "every step, which needs every replica at every step; live recovery serves local "
                              "methods (syncs every few steps)")
        self.heals, self._syncs = 0, 0
        manager.register_state_dict_fn("commhooks", self._load, self._save)
        self._quorum_due = False
        first = self.optimizers[0]
        self._handles = [
            # before the state's own pre-hook (a global one runs first): the next quorum, with the scheduler
            # stepped, so a group healed there gets a whole step's state
            register_optimizer_step_pre_hook(lambda opt, *args: self._before_step() if opt is first else None),
            self.optimizers[-1].register_step_post_hook(lambda *args: self._after_step())]
        self.comm.requorum()  # join; behind (a late start, a restart): healed from a live group here
        error = manager.errored()  # torchft records a failed heal instead of raising: this group is not the others'
        if error is not None:
            raise CollectiveError(f"commhooks.torchft.register: joining the quorum failed ({error.original_exception})"
                                  "; this group holds its own state, not the live groups': start it again")
        fresh = manager.current_step() == 0
        if fresh:
            # a fresh job (torchft's init_sync makes every group of this quorum one model): meet once, after every
            # heal is done (a group serves its state only until it commits), and count a first step, so that a
            # group started later, at step 0, is behind every live group and heals from them, never they from it
            self.comm.allreduce([torch.zeros(1, device=self.comm.device)], op="sum", tag="join", metered=False)
            self.commit()
        self.checkpointer, self.resumed_from = None, None
        if checkpoint_dir is not None:
            # the group's own ranks write its checkpoints (each group a folder of its own), at the hook's steps,
            # which every live group shares; no save waits for another group
            self.checkpointer = Checkpointer(checkpoint_dir, model, optimizer, self.state, scheduler,
                                             every_steps=checkpoint_every, resume="never")
            if fresh:  # the whole job started (again): every group of the first quorum from the same step
                self._resume(Path(checkpoint_dir))

    def _resume(self, directory: Path) -> None:
        """A cold start of the whole job: the groups of the first quorum agree on the newest step every one of them
        committed (the minimum of their newest: a group cut off before its last commit holds the one before, as
        ``keep`` >= 2 keeps it) and each loads its own checkpoint of that step: bit-exact where no group was lost."""
        newest = [read_manifest(f)["step"] for f in complete_folders(directory)[:1]] if directory.is_dir() else []
        agreed = torch.tensor([-float(newest[0] if newest else 0)], dtype=torch.float64, device=self.comm.device)
        self.comm.allreduce([agreed], op="max", tag="checkpoint", metered=False)
        step = int(-agreed.item())
        if step == 0:
            return
        if read_manifest(step_folder(directory, step)) is None:
            raise CheckpointError(f"commhooks.torchft: the replica groups' newest common checkpoint is step {step}, "
                                  f"and this group's folder {directory} no longer has it complete (keep more than "
                                  "one checkpoint per group)")
        load_checkpoint(directory, self.model, self.optimizers if len(self.optimizers) > 1 else self.optimizers[0],
                        self.state, self.scheduler, step=step)
        self.resumed_from, self._syncs = step, self.state.syncs

    # ------------------------------------------------------------------ healing

    def _fingerprint(self) -> dict:
        """What every group must share (built alone, the state compared nothing with the others)."""
        return {"config": to_dict(self.state.config), "version": __version__,
                "params": [[n, list(p.shape)] for n, p in self.state.named_params]}

    def _save(self) -> dict:
        """What a joining group copies (a copy: torchft serves it while this group trains on)."""
        return host_copy({
            "fingerprint": self._fingerprint(),
            "model": {k: _local(v) for k, v in getattr(self.model, "module", self.model).state_dict().items()},
            "optimizer": [_local_optimizer_state(o.state_dict()) for o in self.optimizers],
            "hook": self.state.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        })

    def _load(self, saved: dict) -> None:
        mine, theirs = self._fingerprint(), saved["fingerprint"]
        if theirs != mine:  # torchft's init_sync heals fresh groups too: a first start is checked as well
            keys = sorted(k for k in mine["config"] if theirs["config"].get(k) != mine["config"][k])
            differ = [f"config key {k}: this group {mine['config'][k]!r}, the live group {theirs['config'].get(k)!r}"
                      for k in keys]
            differ += [f"{what}: this group {mine[what]}, the live group {theirs[what]}" for what in ("version",)
                       if mine[what] != theirs[what]]
            differ += ["the parameters' names or shapes"] if mine["params"] != theirs["params"] else []
            raise ConfigError("commhooks.torchft: this replica group differs from the live group it would heal "
                              "from: " + "; ".join(differ))
        with torch.no_grad():  # in place, through each DTensor to this rank's shard: the same rank's of the live group
            for key, tensor in getattr(self.model, "module", self.model).state_dict().items():
                _local(tensor).copy_(saved["model"][key])
        for opt, s in zip(self.optimizers, saved["optimizer"]):
            opt.load_state_dict(s)
            _shard_optimizer_state(opt)
        self.state.load_state_dict(saved["hook"])
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        self.state.copied_from_peer()
        self.heals += 1
        self._syncs = self.state.syncs

    # ------------------------------------------------------------------ each step

    def _before_step(self) -> None:
        if self._quorum_due:
            self._quorum_due = False
            self.comm.requorum()

    def _after_step(self) -> None:
        # a step that sent something, or synced (alone, a group's sync sends nothing: it still takes a quorum,
        # where a restarted group is admitted)
        if self.comm.used or self.state.syncs != self._syncs:
            self.commit()

    def after_step(self) -> bool:
        """Call once per optimizer step, after the scheduler's step, on every rank (with ``checkpoint_dir``: saves
        when due, as :meth:`commhooks.Checkpointer.after_step`); returns whether a save started."""
        return self.checkpointer is not None and self.checkpointer.after_step()

    def commit(self) -> None:
        """End a step that communicated: torchft's vote; the next quorum (where joining groups heal) comes at the
        start of the next optimizer step, once the loop has stepped its scheduler."""
        self.comm.used, self._syncs = False, self.state.syncs
        if not self.manager.should_commit():
            error = self.manager.errored()
            raise CollectiveError(f"torchft voted step {self.state.step} down: " + (
                f"an error it could not recover ({error.original_exception})" if error is not None else
                f"fewer groups ({self.manager.num_participants()}) than the Manager's min_replica_size"))
        self._quorum_due = True

    @property
    def retries(self) -> int:
        """Collectives tried again on a smaller quorum (each a group lost during a sync)."""
        return self.comm.retries

    @property
    def groups(self) -> int:
        """Replica groups in the current quorum."""
        return self.comm.size

    def close(self, finish: bool = True) -> None:
        """End the run: with ``finish``, the open round is synced (every live group ends with the same model)."""
        if finish:
            self.state.finish()
            if self.comm.used or self.state.syncs != self._syncs:
                self.commit()
                self._quorum_due = False
        for handle in self._handles:
            handle.remove()
        if self.checkpointer is not None:
            self.checkpointer.close()


# ---------------------------------------------------------------------- the group's own engine


def _engine(model):
    """The tensors the state syncs and the engine's facts.  Each Comm member is a whole replica group
    (``local_world_size=1``: no ranks of a node inside the comm); a ``fully_shard`` model syncs this rank's local
    shards with rank i of the other groups (FSDP2 averages inside the group, as under :mod:`commhooks.fsdp`); a
    DDP model (DDP averages every step inside the group) syncs the whole model, the same on each of its ranks."""
    if _is_fully_sharded(model):
        shard_group(model)  # the model's checks: one 1-D mesh over the group, every parameter sharded
        named, slices = local_shards(model)
        return named, facts.for_model(model, replica_data_parallel=True, local_world_size=1, master_slices=slices)
    return None, facts.for_model(model, local_world_size=1)


def _is_fully_sharded(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def _local(tensor):
    """This rank's part of a DTensor (FSDP2's parameters and optimizer state), a plain tensor as it is: a heal copies
    rank i's shards from rank i of a live group, never a DTensor (whose mesh is this group's)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _local_optimizer_state(saved: dict) -> dict:
    return {**saved, "state": {i: {k: _local(v) for k, v in entry.items()} for i, entry in saved["state"].items()}}


def _shard_optimizer_state(optimizer) -> None:
    """After ``load_state_dict`` of local parts: each state tensor of a DTensor parameter a DTensor again, laid out
    as its parameter (``exp_avg`` and the like have the parameter's shape; ``step`` stays as torch keeps it)."""
    from torch.distributed.tensor import DTensor

    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            entry = optimizer.state.get(param, {})
            for key, value in entry.items():
                if not isinstance(value, DTensor) and value.shape == param.to_local().shape and value.dim() > 0:
                    entry[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                    shape=param.shape, stride=param.stride())


def register(model, optimizer, config, manager, scheduler=None, checkpoint_dir=None, checkpoint_every: int = 0,
             **state_options) -> LiveGroups:
    """Build ``config``'s state over torchft's ``manager`` and join the quorum; see the module's docstring.

    ``checkpoint_dir`` (a folder of this replica group's own, e.g. ``ckpt/group0``) and ``checkpoint_every`` (steps):
    the group saves there (call :meth:`LiveGroups.after_step` after each scheduler step), and a start of the whole
    job resumes every group from the newest step all of them committed."""
    return LiveGroups(model, optimizer, config, manager, scheduler, checkpoint_dir, checkpoint_every, **state_options)
