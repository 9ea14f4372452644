"""One validated config schema for every entry point, declared with pydantic.

Python users pass keyword arguments or a config object; JSON files in
``configs/`` and the ``"comm_hook"`` section of a DeepSpeed config are plain
dicts with a ``"type"`` key naming a registered algorithm (``"qsr"``,
``"ab"``, ...) or ``"none"``, and the fields of that algorithm's config class.

Each algorithm declares its config as a subclass of :class:`HookConfig`: field
types and ranges are constraints on the fields (``Annotated[int, Field(ge=1)]``),
cross-field rules a ``model_validator``; the class is registered once with its
state (:mod:`commhooks.registry`).  Validation is strict (``1`` is not ``true``,
``"4"`` is not ``4``), unknown keys are refused, and every failure becomes a
:class:`ConfigError` that names the key, the value and what is allowed.  It is
local and deterministic, so every rank raises the same error before any
collective is issued (no hang).

The JSON schema of all registered configs (``commhooks schema``) and the
docs' key tables (``commhooks schema --readme docs/pages/reference/config.md``) are generated from the
same classes.
"""

from __future__ import annotations

import contextvars
import json
import os
import typing
from pathlib import Path
from typing import Any, List, Literal, Mapping, Optional, Union

import annotated_types
import pydantic
from pydantic import BaseModel, ConfigDict, Field
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


# --------------------------------------------------------------------------
# errors: pydantic's, in words that name the key, the value and what is allowed
# --------------------------------------------------------------------------

_TYPE_ERRORS = ("int_type", "int_parsing", "int_from_float", "float_type", "float_parsing", "finite_number",
                "bool_type", "bool_parsing", "string_type", "list_type", "dict_type", "none_required", "is_instance_of")
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _expected(annotation) -> str:
    """What a value of ``annotation`` must be, in words ("an integer or null", "a list of strings")."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _expected(args[0])
    if origin is Union:
        rest = [a for a in args if a is not type(None)]
        words = " or ".join(_expected(a) for a in rest)
        return words + (" or null" if len(rest) < len(args) else "")
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (list, List):
        return f"a list of {_expected(args[0])[2:]}s" if args else "a list"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(field) -> str:
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
        return f"{prefix}{key} must be {_expected(field.annotation)}, got {value!r}"
    if kind == "literal_error":
        return f"{prefix}{key} must be {_expected(field.annotation)}, got {value!r}"
    if kind in _BOUND_ERRORS:
        return f"{prefix}{key} must be {_bounds(field)}, got {value!r}"
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
# entry points
# --------------------------------------------------------------------------


def _registry():
    from . import registry

    return registry


def from_dict(data: Mapping[str, Any], kind: Optional[str] = None, where: str = "config"):
    """Build a validated config from a dict.

    ``kind`` selects the schema; otherwise ``data["type"]`` does.  Unknown keys
    raise :class:`ConfigError` listing the allowed ones (a typo must not be
    silently ignored on a 128-GPU job).  ``{"type": "none"}`` gives ``None``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object / dict, got {type(data).__name__}")
    data = dict(data)
    declared = data.pop("type", None)
    if kind is None:
        kind = declared
    elif declared is not None and declared != kind:
        raise ConfigError(f"{where}.type is {declared!r} but a {kind!r} config was expected")
    names = ["none", *_registry().names()]
    if kind is None:
        raise ConfigError(f"{where}.type is required: one of {', '.join(map(repr, names))}")
    if kind == "none":
        if data:
            raise ConfigError(f"{where}: type 'none' takes no other keys, got {sorted(data)}")
        return None
    if not isinstance(kind, str) or kind not in names:
        raise ConfigError(f"{where}.type must be one of {', '.join(map(repr, names))}, got {kind!r}")
    return validate(_registry().get(kind).config_class, data, where)


def read_json(path, what: str = "config file") -> Any:
    """A JSON file's contents; a missing file or bad JSON is a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {str(path)!r} is not valid JSON: {exc}") from None


def load_config(source: Union[None, str, os.PathLike, Mapping[str, Any], HookConfig], kind: Optional[str] = None):
    """Turn any accepted form of hook settings into a validated config object.

    Accepted: a config object (returned as is), a dict, a path to a JSON
    file, the name of a shipped config (``"qsr_mnist1d"``; ``commhooks
    configs`` lists them), or a DeepSpeed config (dict or path) with a
    top-level ``"comm_hook"`` section.  Returns ``None`` for ``{"type": "none"}``.
    """
    if source is None:
        return None
    if isinstance(source, HookConfig):
        if kind is not None and source.kind != kind:
            raise ConfigError(f"a {kind!r} config was expected, got a {source.kind!r} config")
        return source
    where = "config"
    if isinstance(source, (str, os.PathLike)):
        from . import shipped

        if isinstance(source, str) and shipped.is_bare_name(source):
            source = shipped.find(source)
        where = Path(source).name
        source = read_json(source)
    if isinstance(source, Mapping) and "comm_hook" in source:
        return from_dict(source["comm_hook"], kind, where=f"{where}.comm_hook")
    return from_dict(source, kind, where=where)


def to_dict(config: Optional[HookConfig]) -> dict:
    """The JSON form of a config, ``type`` key first (round-trips through :func:`load_config`)."""
    if config is None:
        return {"type": "none"}
    return {"type": config.kind, **config.model_dump(mode="json", exclude={"type"})}


# --------------------------------------------------------------------------
# generated documentation: JSON schema and the docs' key tables
# --------------------------------------------------------------------------


def json_schema() -> dict:
    """The JSON schema of a ``comm_hook`` section: a union of the registered configs, discriminated by ``type``."""
    classes = [a.config_class for a in _registry().algorithms()]
    union = classes[0] if len(classes) == 1 else Annotated[Union[tuple(classes)], Field(discriminator="type")]
    schema = pydantic.TypeAdapter(union).json_schema()
    schema["title"] = "commhooks comm_hook section"
    return schema


def _allowed(field) -> str:
    words = _expected(field.annotation)
    if any(isinstance(m, (annotated_types.Ge, annotated_types.Gt, annotated_types.Le, annotated_types.Lt))
           for m in field.metadata):
        words += f", {_bounds(field)}"
    return words


def key_table(kind: str) -> str:
    """The markdown table of an algorithm's keys: key, allowed values, default, meaning."""
    cls = _registry().get(kind).config_class
    rows = ["| key | allowed | default | meaning |", "|---|---|---|---|"]
    for name, field in _own_fields_first(cls):
        default = json.dumps(field.get_default(call_default_factory=True))
        text = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {_allowed(field)} | `{default}` | {text} |")
    return "\n".join(rows)


def _own_fields_first(cls):
    """(name, field) of ``cls``: its own keys first, then those of its bases (the shared safety keys last)."""
    seen = []
    for klass in cls.__mro__:
        for name in vars(klass).get("__annotations__", {}):
            if name in cls.model_fields and name != "type" and name not in seen:
                seen.append(name)
    return [(name, cls.model_fields[name]) for name in seen]


TABLE_BEGIN = "<!-- commhooks:keys {kind} (generated by `commhooks schema --readme FILE`; do not edit) -->"
TABLE_END = "<!-- /commhooks:keys -->"


def update_tables(text: str) -> str:
    """``text`` with every generated key table replaced by the current one."""
    out, pos = [], 0
    for algo in _registry().algorithms():
        begin = TABLE_BEGIN.format(kind=algo.name)
        start = text.find(begin, pos)
        if start < 0:
            continue
        end = text.find(TABLE_END, start)
        if end < 0:
            raise ConfigError(f"the key table for {algo.name!r} has no end marker {TABLE_END}")
        out.append(text[pos:start] + begin + "\n" + key_table(algo.name) + "\n")
        pos = end
    return "".join(out) + text[pos:]


def __getattr__(name: str):
    """``commhooks.config.QSRConfig`` and friends: the config classes of the registered algorithms."""
    for algo in _registry().algorithms():
        if algo.config_class.__name__ == name:
            return algo.config_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ConfigError", "HookConfig", "from_dict", "load_config", "to_dict", "read_json", "json_schema",
           "key_table", "update_tables", "validate"]
