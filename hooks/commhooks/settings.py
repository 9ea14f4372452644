"""The bottom of every config: the :class:`HookConfig` base, :class:`ConfigError`, and pydantic's errors in words.

Each algorithm declares its config as a subclass of :class:`HookConfig`: field
types and ranges are constraints on the fields (``Annotated[int, Field(ge=1)]``),
cross-field rules a ``model_validator``.  Validation is strict (``1`` is not
``true``, ``"4"`` is not ``4``), unknown keys are refused, and every failure
becomes a :class:`ConfigError` that names the key, the value and what is
allowed.  It is local and deterministic, so every rank raises the same error
before any collective is issued (no hang).

Why a module of its own, below everything else in the package: the algorithms
declare their configs with it, and the communication layer raises its errors,
while loading a config by its ``type`` (:mod:`commhooks.config`) needs the
registry, which sits above the algorithms.  This module imports nothing from
commhooks, so any layer may use it.
"""

from __future__ import annotations

import contextvars
import json
import typing
from pathlib import Path
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple, Union

import annotated_types
import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Annotated


class ConfigError(ValueError):
    """A hook setting is missing, unknown or outside its allowed range."""


# --------------------------------------------------------------------------
# the base every algorithm's config derives from
# --------------------------------------------------------------------------


# the prefix of error messages while :func:`validate` builds a config; None: the algorithm's type ("qsr.")
_ERROR_PREFIX: "contextvars.ContextVar[Optional[str]]" = contextvars.ContextVar("commhooks_config_prefix", default=None)


class HookConfig(BaseModel):
    """Settings every algorithm shares: how it guards a long job against silent divergence and hangs.

    Subclasses add a ``type: Literal["<name>"] = "<name>"`` field (the
    discriminator) and their own fields, each with a ``description`` (it is
    the docs' key table).
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, validate_default=False)

    check_every: Annotated[int, Field(ge=0, description=(
        "every N-th sync, compare per-tensor checksums across ranks and raise naming the tensors that "
        "differ (0 = never)"))] = 10
    nonfinite: Literal["raise", "skip"] = Field("raise", description=(
        "a NaN/Inf gradient: raise (checked on the device, no host stall; every rank raises at the next sync, "
        "naming the step and the parameter) or skip the update (the step still counts, so ranks stay in step; "
        "one host read per step)"))
    timeout_s: Annotated[float, Field(gt=0.0, description=(
        "seconds any collective of the hook may take before it fails with an error naming the collective "
        "and the group (on NCCL: the timeout of the groups the hook creates, enforced by NCCL's watchdog)"))] = 300.0
    log_every: Annotated[int, Field(ge=0, description=(
        "every N optimizer steps, rank 0 logs one line (Python logging, logger \"commhooks\", level INFO): step, "
        "phase, period, syncs, bytes sent and what plain allreduce would have sent (0 = off)"))] = 0

    def __init__(self, **data: Any):
        """Validate ``data``; any failure is a :class:`ConfigError` naming the key, the value and what is allowed."""
        try:
            super().__init__(**data)
        except pydantic.ValidationError as exc:
            cls = type(self)
            prefix = _ERROR_PREFIX.get() or (f"{cls.model_fields['type'].default}." if "type" in cls.model_fields else "")
            raise ConfigError("; ".join(_describe_error(cls, e, prefix) for e in exc.errors())) from None

    @property
    def kind(self) -> str:
        """The registered name of the algorithm (the ``type`` key)."""
        return self.type  # type: ignore[attr-defined]

    def inactive_keys(self) -> Dict[str, str]:
        """The keys that cannot act given the others, each with what it needs (``{"overlap_alpha": "with
        overlap_steps > 0"}``); subclasses extend their parents'.  A key listed here and set to a value other
        than its default is refused: a setting that changes nothing is a mistake the user should hear of."""
        return {}

    @model_validator(mode="after")
    def _refuse_inactive_keys(self) -> "HookConfig":
        prefix = _ERROR_PREFIX.get() or (f"{self.kind}." if "type" in type(self).model_fields else "")
        fields = type(self).model_fields
        idle = [(key, need) for key, need in self.inactive_keys().items() if key in self.model_fields_set
                and getattr(self, key) != fields[key].get_default(call_default_factory=True)]
        if idle:
            raise ValueError("; ".join(f"{prefix}{key} {getattr(self, key)!r} has no effect here: it acts only {need}"
                                       for key, need in idle) + " (set what it needs, or leave it out)")
        return self


# --------------------------------------------------------------------------
# errors: pydantic's, in words that name the key, the value and what is allowed
# --------------------------------------------------------------------------

_TYPE_ERRORS = ("int_type", "int_parsing", "int_from_float", "float_type", "float_parsing", "finite_number",
                "bool_type", "bool_parsing", "string_type", "list_type", "dict_type", "none_required", "is_instance_of")
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def expected(annotation) -> str:
    """What a value of ``annotation`` must be, in words ("an integer or null", "a list of strings")."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return expected(args[0])
    if origin is Union:
        rest = [a for a in args if a is not type(None)]
        words = " or ".join(expected(a) for a in rest)
        return words + (" or null" if len(rest) < len(args) else "")
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, List):
        return f"a list of {expected(args[0])[2:]}s" if args else "a list"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


def bounds(field) -> str:
    """The allowed range of a numeric field, e.g. ``>= 1`` or ``in (0.0, 1.0)``."""
    lo = hi = None
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            lo = f"[{m.ge}"
        elif isinstance(m, annotated_types.Gt):
            lo = f"({m.gt}"
        elif isinstance(m, annotated_types.Le):
            hi = f"{m.le}]"
        elif isinstance(m, annotated_types.Lt):
            hi = f"{m.lt})"
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    if hi:
        return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
    return "in range"


def _describe_error(cls, err: dict, prefix: str) -> str:
    loc = err.get("loc") or ()
    key = str(loc[0]) if loc else ""
    field = cls.model_fields.get(key)
    value = err.get("input")
    kind = err["type"]
    if kind == "value_error":  # our validators write whole sentences that name their keys
        return str(err["ctx"]["error"])
    if kind == "extra_forbidden":
        allowed = ", ".join(k for k in cls.model_fields if k != "type")
        return f"{prefix.rstrip('.')}: unknown key {key!r}; allowed: {allowed}"
    if field is None:
        return f"{prefix.rstrip('.')}: {err['msg']}"
    if kind in _TYPE_ERRORS:
        return f"{prefix}{key} must be {expected(field.annotation)}, got {value!r}"
    if kind == "literal_error":
        return f"{prefix}{key} must be {expected(field.annotation)}, got {value!r}"
    if kind in _BOUND_ERRORS:
        return f"{prefix}{key} must be {bounds(field)}, got {value!r}"
    return f"{prefix}{key}: {err['msg']}, got {value!r}"


def validate(cls, data: Mapping[str, Any], where: str = "config"):
    """``cls`` built from ``data`` (no ``type`` key), or ConfigError naming the keys."""
    kind = cls.model_fields["type"].default
    allowed = [k for k in cls.model_fields if k != "type"]
    unknown = sorted(set(data) - set(allowed), key=repr)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))} for type {kind!r}; allowed: {', '.join(allowed)}"
        )
    # errors name the key as the user wrote it: "comm_hook.payload" in a DeepSpeed config, "qsr.payload" elsewhere
    token = _ERROR_PREFIX.set("comm_hook." if where.endswith("comm_hook") else None)
    try:
        return cls(**data)
    finally:
        _ERROR_PREFIX.reset(token)


# --------------------------------------------------------------------------
# the pieces of loading that need no registry: a dict's type, a file, the JSON form
# --------------------------------------------------------------------------


def split_type(data: Any, kind: Optional[str], where: str = "config") -> Tuple[dict, Optional[str]]:
    """``data`` (a dict) without its ``type`` key, and the type it is: ``kind`` if given (``data`` naming another
    type is a ConfigError), else the one ``data`` names (None if it names none)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object / dict, got {type(data).__name__}")
    data = dict(data)
    declared = data.pop("type", None)
    if kind is None:
        kind = declared
    elif declared is not None and declared != kind:
        raise ConfigError(f"{where}.type is {declared!r} but a {kind!r} config was expected")
    return data, kind


def expect_kind(config: HookConfig, kind: Optional[str]) -> HookConfig:
    """``config``, if it is of type ``kind`` (None: any); a ConfigError otherwise."""
    if kind is not None and config.kind != kind:
        raise ConfigError(f"a {kind!r} config was expected, got a {config.kind!r} config")
    return config


def read_json(path, what: str = "config file") -> Any:
    """A JSON file's contents; a missing file or bad JSON is a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid JSON: {exc}") from None


def to_dict(config: Optional[HookConfig]) -> dict:
    """The JSON form of a config, ``type`` key first (round-trips through :func:`commhooks.config.load_config`)."""
    if config is None:
        return {"type": "none"}
    return {"type": config.kind, **config.model_dump(mode="json", exclude={"type"})}


__all__ = ["ConfigError", "HookConfig", "bounds", "expect_kind", "expected", "read_json", "split_type", "to_dict",
           "validate"]
