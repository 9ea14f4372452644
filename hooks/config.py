"""One validated config schema for every entry point.

Python users pass keyword arguments or a config object; JSON files in
``configs/`` and the ``"comm_hook"`` section of a DeepSpeed config are plain
dicts with a ``"type"`` key (``"qsr"``, ``"ab"`` or ``"none"``) and the fields
of the matching dataclass.  Every bad value raises :class:`ConfigError` naming
the key and what is allowed; validation is local and deterministic, so every
rank raises the same error before any collective is issued (no hang).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, List, Mapping, Optional, Union


class ConfigError(ValueError):
    """A hook setting is missing, unknown or outside its allowed range."""


# --------------------------------------------------------------------------
# small checkers: each names the key and the allowed range in its message
# --------------------------------------------------------------------------


def check_int(key: str, value: Any, minimum: Optional[int] = None, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an integer or null" if allow_none else "an integer"
        raise ConfigError(f"{key} must be {kind}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value!r}")
    return value


def check_number(
    key: str,
    value: Any,
    minimum: Optional[float] = None,
    maximum: Optional[float] = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    low_ok = minimum is None or (value >= minimum if min_inclusive else value > minimum)
    high_ok = maximum is None or (value <= maximum if max_inclusive else value < maximum)
    if not (low_ok and high_ok):
        lo = "" if minimum is None else f"{'[' if min_inclusive else '('}{minimum}"
        hi = "" if maximum is None else f"{maximum}{']' if max_inclusive else ')'}"
        if minimum is not None and maximum is not None:
            allowed = f"in {lo}, {hi}"
        elif minimum is not None:
            allowed = f"{'>=' if min_inclusive else '>'} {minimum}"
        else:
            allowed = f"{'<=' if max_inclusive else '<'} {maximum}"
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")
    return float(value)


def check_bool(key: str, value: Any):
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def check_choice(key: str, value: Any, choices):
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


# --------------------------------------------------------------------------
# schemas
# --------------------------------------------------------------------------


@dataclasses.dataclass
class SafetyConfig:
    """Settings both hooks share: how they guard a long job against silent divergence and hangs.

    * ``check_every``: every N-th sync, compare a checksum of the parameters
      across ranks and raise naming the tensors that differ (0 = never).
    * ``nonfinite``: with ``"raise"`` a NaN/Inf gradient raises an error naming
      the parameter; with ``"skip"`` the step makes no update (counted in
      ``state.skipped_steps``; the step still counts, so ranks stay in step).
    * ``timeout_s``: seconds any collective of the hook may take before it
      fails with an error naming the collective and the group.
    """

    check_every: int = 10
    nonfinite: str = "raise"
    timeout_s: float = 300.0

    def _check_safety(self, p: str) -> None:
        check_int(p + "check_every", self.check_every, minimum=0)
        check_choice(p + "nonfinite", self.nonfinite, ("raise", "skip"))
        self.timeout_s = check_number(p + "timeout_s", self.timeout_s, minimum=0.0, min_inclusive=False)


@dataclasses.dataclass
class QSRConfig(SafetyConfig):
    """Local SGD / local AdamW synchronised by the Quadratic Synchronisation Rule.

    After a sync, the next round lasts
    ``H = max(h_base, floor((alpha / lr) ** power))`` optimizer steps
    (``init_h`` while ``step < warmup_steps``; capped at the remaining steps when
    ``total_steps`` is known; at least 1).

    Tuning: ``h_base`` is the period at peak lr (the paper uses 4 for ViT-B
    and 2 for ResNet).  The rule exceeds ``h_base`` once
    ``lr < alpha / h_base ** (1 / power)``; the paper's ViT setting
    (alpha 0.0175, peak lr 0.008, h_base 4) puts that point at the peak, so
    the rule governs the whole decay: start from ``alpha ~ peak_lr *
    sqrt(h_base)`` and raise it to thin communication further.
    ``warmup_steps`` must cover the lr warm-up (a tiny warm-up lr would
    otherwise give a huge H).  ``alpha = 0`` gives constant ``H = h_base``.
    """

    kind = "qsr"

    alpha: float = 0.0
    h_base: int = 4
    init_h: Optional[int] = None
    warmup_steps: int = 0
    total_steps: Optional[int] = None
    power: float = 2.0
    average_optimizer_state: bool = False
    average_buffers: bool = True

    def __post_init__(self):
        p = "qsr."
        self.alpha = check_number(p + "alpha", self.alpha, minimum=0.0)
        check_int(p + "h_base", self.h_base, minimum=1)
        check_int(p + "init_h", self.init_h, minimum=1, allow_none=True)
        check_int(p + "warmup_steps", self.warmup_steps, minimum=0)
        check_int(p + "total_steps", self.total_steps, minimum=1, allow_none=True)
        self.power = check_number(p + "power", self.power, minimum=0.0, min_inclusive=False)
        check_bool(p + "average_optimizer_state", self.average_optimizer_state)
        check_bool(p + "average_buffers", self.average_buffers)
        self._check_safety(p)

    @property
    def warmup_h(self) -> int:
        """Period used while ``step < warmup_steps`` (``init_h``, default ``h_base``)."""
        return self.h_base if self.init_h is None else self.init_h


@dataclasses.dataclass
class ABConfig(SafetyConfig):
    """AB-training: low-rank factors trained by independent groups, averaged periodically.

    Coquelin et al., arXiv 2405.01067.  Defaults are the paper's VGG16 /
    CIFAR-10 settings (8 GPUs, batch 1024): scale ``warmup_steps``,
    ``sync_period``, ``full_rank_steps`` and ``rebound_steps`` with the
    length of your run (the paper: warm-up ~10 % of training, a sync about
    every 1.7 epochs, 8 % of each period at full rank).

    ``sync_rule="qsr"`` lets the groups sync by the Quadratic Synchronisation
    Rule instead of every ``sync_period`` steps: each AB phase after the
    first lasts ``H - full_rank_steps`` steps with
    ``H = max(h_base, floor((alpha / lr) ** power))`` from the lr of the
    phase's first step (capped at ``total_steps``).  ``h_base`` defaults to
    ``sync_period``, so ``alpha = 0`` is plain AB.  ``local_group_steps``
    also drops the intra-group traffic of AB steps: each rank trains its
    factor on its own gradients until the group sync (QSR inside the group).
    """

    kind = "ab"

    warmup_steps: int = 4330
    sync_period: int = 759
    full_rank_steps: int = 60
    rank_cutoff: float = 0.15
    group_size: Optional[int] = None
    mode: str = "groups"
    sync: str = "full"
    full_rank: List[str] = dataclasses.field(default_factory=list)
    min_compression_rate: float = 2.0
    truncate_first: bool = False
    rebound_steps: int = 0
    sync_rule: str = "fixed"
    alpha: float = 0.0
    h_base: Optional[int] = None
    power: float = 2.0
    total_steps: Optional[int] = None
    local_group_steps: bool = False

    def __post_init__(self):
        p = "ab."
        check_int(p + "warmup_steps", self.warmup_steps, minimum=0)
        check_int(p + "sync_period", self.sync_period, minimum=1)
        check_int(p + "full_rank_steps", self.full_rank_steps, minimum=0)
        if self.full_rank_steps >= self.sync_period:
            raise ConfigError(
                f"ab.sync_period must be > ab.full_rank_steps, got sync_period={self.sync_period}, "
                f"full_rank_steps={self.full_rank_steps}"
            )
        self.rank_cutoff = check_number(
            p + "rank_cutoff", self.rank_cutoff, minimum=0.0, maximum=1.0, min_inclusive=False, max_inclusive=False
        )
        if self.group_size is not None:
            check_int(p + "group_size", self.group_size)
            if self.group_size < 1 and self.group_size != -1:
                raise ConfigError(f"ab.group_size must be >= 1, -1 (two halves) or null (ranks per node), got {self.group_size}")
        check_choice(p + "mode", self.mode, ("groups", "only-b"))
        check_choice(p + "sync", self.sync, ("full", "with-stale"))
        if not isinstance(self.full_rank, (list, tuple)) or not all(isinstance(x, str) for x in self.full_rank):
            raise ConfigError(f"ab.full_rank must be a list of parameter name patterns, got {self.full_rank!r}")
        self.full_rank = list(self.full_rank)
        self.min_compression_rate = check_number(p + "min_compression_rate", self.min_compression_rate, minimum=0.0)
        check_bool(p + "truncate_first", self.truncate_first)
        check_int(p + "rebound_steps", self.rebound_steps, minimum=0)
        check_choice(p + "sync_rule", self.sync_rule, ("fixed", "qsr"))
        self.alpha = check_number(p + "alpha", self.alpha, minimum=0.0)
        check_int(p + "h_base", self.h_base, minimum=1, allow_none=True)
        self.power = check_number(p + "power", self.power, minimum=0.0, min_inclusive=False)
        check_int(p + "total_steps", self.total_steps, minimum=1, allow_none=True)
        check_bool(p + "local_group_steps", self.local_group_steps)
        self._check_safety(p)
        if self.sync_rule == "qsr" and self.period_base <= self.full_rank_steps:
            raise ConfigError(
                f"ab.h_base must be > ab.full_rank_steps with sync_rule 'qsr', got h_base={self.period_base}, "
                f"full_rank_steps={self.full_rank_steps}"
            )

    @property
    def period_base(self) -> int:
        """Smallest sync-to-sync period under ``sync_rule="qsr"`` (``h_base``, default ``sync_period``)."""
        return self.sync_period if self.h_base is None else self.h_base


SCHEMAS = {"qsr": QSRConfig, "ab": ABConfig}


def from_dict(data: Mapping[str, Any], kind: Optional[str] = None, where: str = "config"):
    """Build a validated config from a dict.

    ``kind`` selects the schema; otherwise ``data["type"]`` does.  Unknown keys
    raise :class:`ConfigError` listing the allowed ones (a typo must not be
    silently ignored on a 128-GPU job).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object / dict, got {type(data).__name__}")
    data = dict(data)
    declared = data.pop("type", None)
    if kind is None:
        kind = declared
    elif declared is not None and declared != kind:
        raise ConfigError(f"{where}.type is {declared!r} but a {kind!r} config was expected")
    if kind in (None, "none"):
        if kind is None:
            raise ConfigError(f"{where}.type is required: one of {', '.join(map(repr, ['none', *SCHEMAS]))}")
        if data:
            raise ConfigError(f"{where}: type 'none' takes no other keys, got {sorted(data)}")
        return None
    check_choice(f"{where}.type", kind, ["none", *SCHEMAS])
    cls = SCHEMAS[kind]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(allowed), key=repr)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))} for type {kind!r}; "
            f"allowed: {', '.join(allowed)}"
        )
    try:
        return cls(**data)
    except TypeError as exc:  # pragma: no cover - dataclass signature mismatch
        raise ConfigError(f"{where}: {exc}") from None


def read_json(path, what: str = "config file") -> Any:
    """A JSON file's contents; a missing file or bad JSON is a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid JSON: {exc}") from None


def load_config(source: Union[None, str, os.PathLike, Mapping[str, Any], Any], kind: Optional[str] = None):
    """Turn any accepted form of hook settings into a validated config object.

    Accepted: a config dataclass (returned as is), a dict, a path to a JSON
    file, or a DeepSpeed config (dict or path) with a top-level ``"comm_hook"``
    section.  Returns ``None`` for ``{"type": "none"}``.
    """
    if source is None:
        return None
    if isinstance(source, tuple(SCHEMAS.values())):
        if kind is not None and source.kind != kind:
            raise ConfigError(f"a {kind!r} config was expected, got a {source.kind!r} config")
        return source
    where = "config"
    if isinstance(source, (str, os.PathLike)):
        where = Path(source).name
        source = read_json(source)
    if isinstance(source, Mapping) and "comm_hook" in source:
        return from_dict(source["comm_hook"], kind, where=f"{where}.comm_hook")
    return from_dict(source, kind, where=where)


def to_dict(config) -> dict:
    """The JSON form of a config, ``type`` key first (round-trips through :func:`load_config`)."""
    if config is None:
        return {"type": "none"}
    return {"type": config.kind, **dataclasses.asdict(config)}
