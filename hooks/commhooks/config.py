"""One validated config schema for every entry point: loading a config, and what is generated from the configs.

Python users pass keyword arguments or a config object; JSON files in
``configs/`` and the ``"comm_hook"`` section of a DeepSpeed config are plain
dicts with a ``"type"`` key naming a registered algorithm (``"qsr"``,
``"ab"``, ...) or ``"none"``, and the fields of that algorithm's config class.

Each algorithm declares its config as a subclass of :class:`HookConfig`
(:mod:`commhooks.settings`: the base, strict validation, :class:`ConfigError`
naming the key, the value and what is allowed), registered once with its state
(:mod:`commhooks.registry`).  This module is the dispatch by ``type``, so it
sits above the registry: :func:`from_dict` and :func:`load_config` build the
config the ``type`` names (:mod:`commhooks.sources` reads files, shipped names
and DeepSpeed sections), and ``commhooks.config.QSRConfig`` names a registered
config class.  The names of :mod:`commhooks.settings` users import from here
(``ConfigError``, ``HookConfig``, ``validate``, ``to_dict``, ``read_json``) are
re-exported.

The JSON schema of all registered configs (``commhooks schema``) and the
docs' key tables (``commhooks schema --readme docs/pages/reference/config.md``) are generated from the
same classes.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

import annotated_types
import pydantic
from pydantic import Field
from typing_extensions import Annotated

from . import registry, sources
from .settings import ConfigError, HookConfig, bounds, expect_kind, expected, read_json, split_type, to_dict, validate

# --------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------


def from_dict(data: Mapping[str, Any], kind: Optional[str] = None, where: str = "config"):
    """Build a validated config from a dict.

    ``kind`` selects the schema; otherwise ``data["type"]`` does.  Unknown keys
    raise :class:`ConfigError` listing the allowed ones (a typo must not be
    silently ignored on a 128-GPU job).  ``{"type": "none"}`` gives ``None``.
    """
    data, kind = split_type(data, kind, where)
    names = ["none", *registry.names()]
    if kind is None:
        raise ConfigError(f"{where}.type is required: one of {', '.join(map(repr, names))}")
    if kind == "none":
        if data:
            raise ConfigError(f"{where}: type 'none' takes no other keys, got {sorted(data)}")
        return None
    if not isinstance(kind, str) or kind not in names:
        raise ConfigError(f"{where}.type must be one of {', '.join(map(repr, names))}, got {kind!r}")
    return validate(registry.get(kind).config_class, data, where)


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
        return expect_kind(source, kind)
    data, where = sources.section(source)
    return from_dict(data, kind, where=where)


# --------------------------------------------------------------------------
# generated documentation: JSON schema and the docs' key tables
# --------------------------------------------------------------------------


def json_schema() -> dict:
    """The JSON schema of a ``comm_hook`` section: a union of the registered configs, discriminated by ``type``."""
    classes = [a.config_class for a in registry.algorithms()]
    union = classes[0] if len(classes) == 1 else Annotated[Union[tuple(classes)], Field(discriminator="type")]
    schema = pydantic.TypeAdapter(union).json_schema()
    schema["title"] = "commhooks comm_hook section"
    return schema


def _allowed(field) -> str:
    words = expected(field.annotation)
    if any(isinstance(m, (annotated_types.Ge, annotated_types.Gt, annotated_types.Le, annotated_types.Lt))
           for m in field.metadata):
        words += f", {bounds(field)}"
    return words


def key_table(kind: str) -> str:
    """The markdown table of an algorithm's keys: key, allowed values, default, meaning."""
    cls = registry.get(kind).config_class
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
    for algo in registry.algorithms():
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
    for algo in registry.algorithms():
        if algo.config_class.__name__ == name:
            return algo.config_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ConfigError", "HookConfig", "from_dict", "load_config", "to_dict", "read_json", "json_schema",
           "key_table", "update_tables", "validate"]
