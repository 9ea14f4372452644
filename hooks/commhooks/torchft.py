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
* **One source per group.**  torchft 0.2.0 picks each rank's source per rank (spreading a heal over the live
  groups), so a group of several ranks would take rank 0's state from one live group and rank 1's from another:
  their optimizer moments differ, and under DDP the group's ranks train different models from there on.  commhooks
  makes every rank of a group take group rank 0's assignment (:mod:`commhooks.torchft_plan`): the whole group heals
  from one live group, at a fresh start too (torchft's ``init_sync`` copies one group's weights to the others, a
  group seeded apart included).  After a heal the group proves it: its ranks compare where their state came from
  and, where each holds the whole model (DDP), the model, optimizer and hook state themselves; a difference is a
  DivergenceError on every rank of the group.  ``check_every`` compares the ranks inside each group too.
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
* **One config.** Whenever a group takes part that the others did not meet in their last quorum (a group healed,
  or the groups of a fresh start), every group compares its config, commhooks version and parameter shapes with
  the others' (48 bytes; the whole descriptions travel only on a difference).  A difference is named on every rank
  of every group, key by key with each group's value: the joining group raises a ``ConfigError``; groups that were
  already training warn and go on without it.
* **A whole job started again** (from checkpoints, after a power cut): the groups of the first quorum agree on the
  newest step every one of them committed and each loads its own checkpoint of it.  A group whose newest checkpoint
  was saved with N groups in the quorum waits (``join_timeout_s``) until N groups have joined before it trains a
  step, whatever the Lighthouse's ``min_replicas``: so a group that starts first never trains ahead alone and
  heals the others into another run.  ``wait_for_groups`` asks the same of a first start (without it, under
  ``min_replicas 1`` the first group up trains alone until the others join, and the run depends on start order).

Tuning: the Manager's ``quorum_timeout`` must exceed the longest round (a joining group waits in ``register``
for the others' next sync); the Lighthouse's ``heartbeat_timeout_ms`` is how soon a lost group is dropped (the
survivors retry until then, within the config's ``timeout_s``).  A group's Managers find each other through a
store: under ``torchrun --max-restarts`` give them one made new at each start (``commhooks.launch.fresh_store()``),
since torchrun's own store keeps a dead start's keys (the old Manager's address).  Not supported: algorithms that
average gradients every step (AB, in both its modes: its A and B groups average factor gradients at every step;
QSR's ``group_size``: the groups are torchft's), the two-step exchange (an all-to-all cut for a fixed number of
groups: ``payload_exchange: "auto"`` means ``"allgather"`` here, and ``"two_step"`` is refused).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import facts, registry
from .algorithms.contract.checks import DivergenceError, flat_description, spread_over_ranks, verify_identical
from .checkpoint import load_checkpoint
from .checkpointer import Checkpointer, host_copy
from .commit import CheckpointError, complete_folders, read_manifest, step_folder
from .comm import Comm
from .comm.base import CollectiveError
from .comm.torch_dist import TorchComm
from .comm.torchft_comm import ManagedComm
from ._version import __version__
from .config import ConfigError, load_config
from .fsdp.model import local_shards, shard_group
from .settings import to_dict
from .torchft_plan import members_named, plan_heals_by_group

log = logging.getLogger("commhooks")



def differences_across(comm: Comm, description: dict) -> Dict[str, List[object]]:
    """The keys of ``description`` (JSON-able; one level into dicts: ``config.h_base``) whose values differ between
    the members of ``comm``, each with every member's value in rank order (``None`` where a member lacks the key);
    ``{}`` where all agree.  One 48-byte max/min allreduce; only on a difference, an allgather of every member's
    description, so that every member can name every value (a group told "differs" without the other's value
    cannot say which side to fix)."""
    if comm.size == 1:
        return {}
    flat = flat_description(json.loads(json.dumps(description, sort_keys=True, default=str)))
    blob = json.dumps(flat, sort_keys=True).encode()
    digest = hashlib.sha256(blob).digest()
    words = torch.tensor([int.from_bytes(digest[i:i + 3], "big") for i in range(0, 24, 3)], dtype=torch.float64,
                         device=comm.device)
    hi, lo = spread_over_ranks(comm, words)
    if torch.equal(hi, lo):
        return {}
    longest = torch.tensor([float(len(blob))], dtype=torch.float64, device=comm.device)
    comm.allreduce([longest], op="max", tag="check", metered=False)
    padded = torch.zeros(int(longest.item()), dtype=torch.float32, device=comm.device)
    padded[:len(blob)] = torch.tensor(list(blob), dtype=torch.float32, device=comm.device)
    theirs = [json.loads(bytes(int(b) for b in t.tolist()).rstrip(b"\0").decode())
              for t in comm.allgather(padded, tag="check", metered=False)]
    keys = sorted(set().union(*theirs))
    return {k: [t.get(k) for t in theirs] for k in keys if len({json.dumps(t.get(k), sort_keys=True)
                                                                for t in theirs}) > 1}

class LiveGroups:
    """A state whose syncs go through torchft; heals, retries and commits around the optimizer's steps."""

    def __init__(self, model, optimizer, config, manager, scheduler=None, checkpoint_dir=None, checkpoint_every=0,
                 wait_for_groups: Optional[int] = None, join_timeout_s: float = 300.0, **state_options):
        config = load_config(config)
        if config is None:
            raise ConfigError("commhooks.torchft.register: config {'type': 'none'} has no syncs to make live")
        algorithm = registry.for_config(config)
        every_step = getattr(algorithm.state_class, "reduces_gradients", False)
        if every_step is True:  # declared by the class (AB): refused before it builds groups over a quorum of one
            raise ConfigError(f"commhooks.torchft.register: {config.kind} averages gradients at every step in every "
                              f"mode ({config.kind}.mode {getattr(config, 'mode', '')!r}: its groups average their "
                              "factor's gradients each step), which needs every replica at every step; live recovery "
                              "serves local methods (syncs every few steps), e.g. {'type': 'qsr'}")
        config = _exchange_for_live_groups(config)
        if checkpoint_dir is not None and (not isinstance(checkpoint_every, int) or isinstance(checkpoint_every, bool)
                                           or checkpoint_every < 1):
            raise ValueError(f"commhooks.torchft.register: checkpoint_every must be a number of steps >= 1 with "
                             f"checkpoint_dir, got {checkpoint_every!r}")
        if wait_for_groups is not None and (not isinstance(wait_for_groups, int) or isinstance(wait_for_groups, bool)
                                            or wait_for_groups < 1):
            raise ValueError(f"commhooks.torchft.register: wait_for_groups must be a number of replica groups >= 1, "
                             f"got {wait_for_groups!r}")
        self.manager, self.model, self.scheduler = manager, model, scheduler
        self.optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if getattr(config, "group_size", None) not in (None, 1):
            raise ConfigError(f"commhooks.torchft.register: {config.kind}.group_size {config.group_size}: under torchft "
                              "the replica groups are torchft's (one Manager per rank of each group, the group's own "
                              "DDP or FSDP2 inside it); leave group_size out")
        self.comm = ManagedComm(manager, timeout_s=config.timeout_s)
        algorithm.check_options(state_options, "commhooks.torchft.register")
        named, engine, inner = _engine(model)
        # the group's own ranks (None: a group of one process), and whether each holds the whole model (DDP)
        self.group = None if inner is None else TorchComm(inner, timeout_s=config.timeout_s)
        self.whole_model_per_rank = self.group is not None and named is None
        self.plan = plan_heals_by_group(manager, *((self.group.rank, self.group.size) if self.group else (0, 1)))
        self.state = algorithm.state_class(optimizer=optimizer, model=model, named_parameters=named, engine=engine,
                                           comm=self.comm, config=config, **state_options)
        if self.state.reduces_gradients:
            self.state.remove()
            raise ConfigError(f"commhooks.torchft.register: this {self.state.display_name} config averages gradients "
                              "every step, which needs every replica at every step; live recovery serves local "
                              "methods (syncs every few steps)")
        self.heals, self._syncs = 0, 0
        self.healed_from: Optional[str] = None  # the replica id of the live group this group last healed from
        self.config_warning: Optional[str] = None  # the last config difference a joining group brought
        self._refused: Optional[str] = None  # why the last heal was not loaded (its config differs)
        self._joining = True  # inside register: a config difference refuses this group (later: warns)
        manager.register_state_dict_fn("commhooks", self._load, self._save)
        self._quorum_due = False
        first = self.optimizers[0]
        self._handles = [
            # before the state's own pre-hook (a global one runs first): the next quorum, with the scheduler
            # stepped, so a group healed there gets a whole step's state
            register_optimizer_step_pre_hook(lambda opt, *args: self._before_step() if opt is first else None),
            self.optimizers[-1].register_step_post_hook(lambda *args: self._after_step())]
        self._record = {"replica_groups": 1}  # saved with each checkpoint: the groups a cold start waits for
        self._requorum(compare_configs=False)  # join; behind (a late start, a restart): healed from a live group
        error = manager.errored()  # torchft records a failed heal instead of raising: this group is not the others'
        if error is not None:
            raise CollectiveError(f"commhooks.torchft.register: joining the quorum failed ({error.original_exception})"
                                  "; this group holds its own state, not the live groups': start it again")
        fresh = manager.current_step() == 0  # (nothing of ours has voted yet: each collective's vote counts a step)
        self.checkpointer, self.resumed_from = None, None
        if fresh:
            need = max(wait_for_groups or 1, _groups_saved(checkpoint_dir, self.group.rank if self.group else 0))
            self._wait_for(need, join_timeout_s, checkpoint_dir)
            # a fresh job (torchft's init_sync makes every group of this quorum one model): meet once, after every
            # heal is done (a group serves its state only until it commits), comparing configs, and count a first
            # step, so that a group started later, at step 0, is behind every live group and heals from them
            self._check_configs(self.plan.news.members)
            self.commit()
        else:  # joined a live job: the live groups compare configs with this one at the same quorum
            self._check_configs(self.plan.news.members)
        if checkpoint_dir is not None:
            # the group's own ranks write its checkpoints (each group a folder of its own), at the hook's steps,
            # which every live group shares; no save waits for another group
            self.checkpointer = Checkpointer(checkpoint_dir, model, optimizer, self.state, scheduler,
                                             every_steps=checkpoint_every, resume="never", extra=self._record)
            if fresh:  # the whole job started (again): every group of the first quorum from the same step
                self._resume(Path(checkpoint_dir))
        self._joining = False

    def _wait_for(self, need: int, timeout_s: float, checkpoint_dir) -> None:
        """A fresh start: ask for quorums until ``need`` groups take part (or raise after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.comm.size < need:
            if time.monotonic() > deadline:
                why = (f"this group's newest checkpoint in {checkpoint_dir} was saved with {need} replica groups in "
                       "the quorum, and resuming it with fewer would make another run" if checkpoint_dir else
                       f"wait_for_groups={need}")
                raise CollectiveError(
                    f"commhooks.torchft.register: {self.comm.size} of {need} replica groups joined within "
                    f"join_timeout_s={timeout_s:g} s ({why}): start every group, or raise join_timeout_s")
            time.sleep(0.2)
            self._requorum(compare_configs=False)  # (no collective until all are in: each would vote a step)

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

    # ------------------------------------------------------------------ quorums, heals and their checks

    def _requorum(self, compare_configs: bool = True) -> None:
        """A new quorum (where a group that is behind heals), then what it calls for: a group that healed proves,
        inside itself, that its ranks hold one state; where a group joined, every group compares configs (a
        joining group does that in ``register``)."""
        self.comm.requorum()
        news = self.plan.news
        if news.heals:
            self._check_heal()
        if compare_configs and news.newcomers:
            self._check_configs(news.members)

    def _check_heal(self) -> None:
        """Inside this group, after it healed: one source on every rank, and (each rank holding the whole model) one
        state; else a DivergenceError on every rank of the group."""
        if self.group is None:
            return
        source = self.healed_from or ""
        digest = hashlib.sha256(source.encode()).digest()
        words = torch.tensor([int.from_bytes(digest[i:i + 3], "big") for i in range(0, 12, 3)],
                             dtype=torch.float64, device=self.group.device)
        hi, lo = spread_over_ranks(self.group, words)
        if not torch.equal(hi, lo):
            raise DivergenceError(
                f"commhooks.torchft: the ranks of this replica group healed from different groups (this rank "
                f"{self.group.rank}: from {source.split(':')[0] or 'none'}); their states would differ from here on")
        if self.whole_model_per_rank:
            verify_identical(self.group, self._whole_state(), f"commhooks.torchft: this replica group's ranks after "
                             f"healing from {source.split(':')[0]} at step {self.state.step}")

    def _whole_state(self) -> List[Tuple[str, torch.Tensor]]:
        """The model's, optimizer's and hook's floating tensors, by name: equal on every rank of a DDP group."""
        named = [(f"model.{k}", v) for k, v in getattr(self.model, "module", self.model).state_dict().items()
                 if torch.is_tensor(v) and v.is_floating_point()]
        for i, opt in enumerate(self.optimizers):
            params = [p for group in opt.param_groups for p in group["params"]]
            named += [(f"optimizer{i}.param{j}.{k}", v) for j, p in enumerate(params)
                      for k, v in sorted(opt.state.get(p, {}).items()) if torch.is_tensor(v) and v.is_floating_point()]
        return named + _floating(self.state.state_dict(), "hook")

    def _check_configs(self, members: Tuple[str, ...]) -> None:
        """Every group of the quorum compares configs; a difference is named on every rank of every group, with
        each group's value: the joining group raises, a group that was training warns and goes on."""
        differ = differences_across(self.comm, self._fingerprint())
        if not differ and self._refused is None:
            return
        names = members_named(list(members))
        lines = [f"{key}: " + ", ".join(f"{names[i] if i < len(names) else i} {value!r}"
                                        for i, value in enumerate(values)) for key, values in differ.items()]
        message = ("commhooks.torchft: the replica groups differ in " + "; ".join(lines or [self._refused or ""]) +
                   " (every group must run the same config, commhooks version and model)")
        if self._joining:
            raise ConfigError(message + "; this group joins, so it stops: start it with the others' config")
        self.config_warning = message + "; this group goes on, and the group that joined is refused"
        warnings.warn(self.config_warning, UserWarning, stacklevel=2)
        log.warning(self.config_warning)

    # ------------------------------------------------------------------ healing

    def _fingerprint(self) -> dict:
        """What every group must share (built alone, the state compared nothing with the others)."""
        return {"config": to_dict(self.state.config), "version": __version__,
                "params": [[n, list(p.shape)] for n, p in self.state.named_params]}

    def _save(self) -> dict:
        """What a joining group copies (a copy: torchft serves it while this group trains on)."""
        return host_copy({
            "origin": self.plan.news.me,
            "fingerprint": self._fingerprint(),
            "model": {k: _local(v) for k, v in getattr(self.model, "module", self.model).state_dict().items()},
            "optimizer": [_local_optimizer_state(o.state_dict()) for o in self.optimizers],
            "hook": self.state.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
        })

    def _load(self, saved: dict) -> None:
        self.healed_from = saved.get("origin")
        mine, theirs = self._fingerprint(), saved["fingerprint"]
        if theirs != mine:  # not loaded: the config check after this quorum names the difference to every group
            self._refused = "the live group's config, version or parameters (not loaded)"
            return
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
            self._requorum()

    def _after_step(self) -> None:
        # a step that sent something, or synced (alone, a group's sync sends nothing: it still takes a quorum,
        # where a restarted group is admitted)
        synced = self.state.syncs != self._syncs
        if synced and self.whole_model_per_rank and self.state.config.check_every \
                and self.state.syncs % self.state.config.check_every == 0:
            verify_identical(self.group, self._whole_state(), f"commhooks.torchft: this replica group's ranks after "
                             f"sync {self.state.syncs} (step {self.state.step})")
        if self.comm.used or synced:
            self.commit()

    def after_step(self) -> bool:
        """Call once per optimizer step, after the scheduler's step, on every rank (with ``checkpoint_dir``: saves
        when due, as :meth:`commhooks.Checkpointer.after_step`); returns whether a save started."""
        self._record["replica_groups"] = self.comm.size
        return self.checkpointer is not None and self.checkpointer.after_step()

    def commit(self) -> None:
        """End a step that communicated: torchft's vote; the next quorum (where joining groups heal) comes at the
        start of the next optimizer step, once the loop has stepped its scheduler."""
        self.comm.used, self._syncs = False, self.state.syncs
        if not self.manager.should_commit():
            error = self.manager.errored()
            raise CollectiveError(f"torchft voted step {self.state.step} down: " + (
                f"an error it could not recover ({error.original_exception})" if error is not None else
                f"fewer groups ({self.manager.num_participants()}) than the Manager's min_replica_size") + (
                f"; earlier: {self.config_warning}" if self.config_warning else ""))
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


def _exchange_for_live_groups(config):
    """``payload_exchange`` as it runs over a quorum that changes: ``auto`` is the allgather (the two-step exchange
    cuts its pieces for a fixed number of groups); ``two_step`` itself is refused, naming the key."""
    if getattr(config, "payload", "fp32") == "fp32":
        return config
    exchange = getattr(config, "payload_exchange", "allgather")
    if exchange == "two_step":
        raise ConfigError(f"commhooks.torchft.register: {config.kind}.payload_exchange 'two_step' (payload "
                          f"{config.payload!r}): its all-to-all is cut for a fixed number of groups, and a torchft "
                          "quorum changes; use \"allgather\" (or \"auto\", which means it here)")
    return config.model_copy(update={"payload_exchange": "allgather"}) if exchange == "auto" else config


def _groups_saved(checkpoint_dir, rank: int) -> int:
    """The replica groups in the quorum when this group saved its newest complete checkpoint (1 if none)."""
    folders = complete_folders(Path(checkpoint_dir)) if checkpoint_dir is not None and Path(checkpoint_dir).is_dir() \
        else []
    if not folders:
        return 1
    path = folders[0] / f"rank{rank}.pt"
    if not path.is_file():
        return 1
    extra = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("extra") or {}
    return int(extra.get("replica_groups", 1))


def _floating(obj, prefix: str) -> List[Tuple[str, torch.Tensor]]:
    """The floating tensors in a nested state dict, named by their path."""
    if torch.is_tensor(obj):
        return [(prefix, obj)] if obj.is_floating_point() else []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return [pair for key, value in items for pair in _floating(value, f"{prefix}.{key}")]


# ---------------------------------------------------------------------- the group's own engine


def _engine(model):
    """The tensors the state syncs (None: the model's), the engine's facts, and the group's own process group (None:
    a group of one process).  Each Comm member is a whole replica group (``local_world_size=1``: no ranks of a node
    inside the comm); a ``fully_shard`` model syncs this rank's local shards with rank i of the other groups (FSDP2
    averages inside the group, as under :mod:`commhooks.fsdp`); a DDP model (DDP averages every step inside the
    group) syncs the whole model, the same on each of its ranks."""
    if _is_fully_sharded(model):
        shard_group(model)  # the model's checks: one 1-D mesh over the group, every parameter sharded
        named, slices = local_shards(model)
        mesh = next(p for p in model.parameters()).device_mesh
        inner = mesh.get_group() if mesh.size() > 1 else None
        return named, facts.for_model(model, replica_data_parallel=True, local_world_size=1,
                                      master_slices=slices), inner
    inner = getattr(model, "process_group", None) if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else None
    if inner is not None and torch.distributed.get_world_size(inner) == 1:
        inner = None
    return None, facts.for_model(model, local_world_size=1), inner


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
             wait_for_groups: Optional[int] = None, join_timeout_s: float = 300.0, **state_options) -> LiveGroups:
    """Build ``config``'s state over torchft's ``manager`` and join the quorum; see the module's docstring.

    ``checkpoint_dir`` (a folder of this replica group's own, e.g. ``ckpt/group0``) and ``checkpoint_every`` (steps):
    the group saves there (call :meth:`LiveGroups.after_step` after each scheduler step), and a start of the whole
    job resumes every group from the newest step all of them committed, once as many groups have joined as the
    quorum held when that checkpoint was saved.  ``wait_for_groups``: the groups a first start waits for before
    its first step (a start that does not depend on which group came first, whatever the Lighthouse's
    ``min_replicas``); ``join_timeout_s``: how long either wait may take before it raises."""
    return LiveGroups(model, optimizer, config, manager, scheduler, checkpoint_dir, checkpoint_every,
                      wait_for_groups, join_timeout_s, **state_options)
