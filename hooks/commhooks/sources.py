"""Where hook settings come from, read into one dict: a dict, a JSON file, a shipped config's name, the
``"comm_hook"`` section of a DeepSpeed config; and a config built from them when its class is known.

Two callers.  :func:`commhooks.config.load_config` reads a source here, then builds the config its ``type``
names, looked up in the registry.  An algorithm's state (``QSRState(optimizer, config="qsr_mnist1d")``) knows
its config class already and sits below the registry, so it builds with :func:`load_as` and
:func:`from_fields`: the same reading and the same errors as ``load_config(source, kind=...)``, without the
look-up by name.  That is why this is a module of its own, above :mod:`commhooks.settings` and
:mod:`commhooks.shipped` and below everything that loads a config.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Tuple

from . import shipped
from .settings import ConfigError, HookConfig, expect_kind, read_json, split_type, validate


def section(source: Any) -> Tuple[Any, str]:
    """The settings ``source`` holds, and where they come from (for error messages).

    ``source``: a dict (where: ``"config"``), a path to a JSON file or the name of a shipped config (where: the
    file's name); a DeepSpeed config (dict or file) gives its ``"comm_hook"`` section (where:
    ``"<file>.comm_hook"``).  The settings are returned as found: checking that they are a dict is the
    builder's job.
    """
    where = "config"
    if isinstance(source, (str, os.PathLike)):
        if isinstance(source, str) and shipped.is_bare_name(source):
            source = shipped.find(source)
        where = Path(source).name
        source = read_json(source)
    if isinstance(source, Mapping) and "comm_hook" in source:
        return source["comm_hook"], f"{where}.comm_hook"
    return source, where


def kind_of(config_class: type) -> str:
    """The type an algorithm's config class declares (the default of its ``type`` field)."""
    field = config_class.model_fields.get("type") if isinstance(config_class, type) else None
    if field is None:
        raise ConfigError(f"{getattr(config_class, '__name__', config_class)} declares no `type`: not an "
                          "algorithm's config (register one with commhooks.register_algorithm)")
    return field.default


def from_fields(config_class: type, data: Any, where: str = "config") -> HookConfig:
    """A ``config_class`` built from ``data`` (a dict; a ``type`` key in it must be the class's own)."""
    data, _ = split_type(data, kind_of(config_class), where)
    return validate(config_class, data, where)


def load_as(config_class: type, source: Any) -> HookConfig:
    """``source`` (a config object, a dict, a JSON path, a shipped config's name, a DeepSpeed config) as a
    ``config_class``: what ``load_config(source, kind=<the class's type>)`` gives for a registered class."""
    if isinstance(source, HookConfig):
        return expect_kind(source, kind_of(config_class))
    data, where = section(source)
    return from_fields(config_class, data, where)
