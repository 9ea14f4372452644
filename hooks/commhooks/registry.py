"""The algorithm registry: one line per algorithm, looked up by every engine adapter and tool.

    commhooks.register_algorithm(MyConfig, MyState)

``MyConfig`` is a :class:`~commhooks.config.HookConfig` subclass whose
``type`` field is ``Literal["my-name"]``; ``MyState`` a
:class:`~commhooks.algorithms.base.AlgorithmState` subclass.  From then on
``{"type": "my-name", ...}`` works wherever a config is accepted: in
``commhooks.ddp.register``, the Horovod ``DistributedOptimizer``, the
DeepSpeed ``"comm_hook"`` section, ``commhooks train --config`` and
``commhooks schema``.  No adapter or tool names an algorithm; they ask this
module.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

_ALGORITHMS: Dict[str, "Algorithm"] = {}
_builtins_loaded = False


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: its name (the config's ``type``), config class and state class."""

    name: str
    config_class: type
    state_class: type


def register_algorithm(config_class: type, state_class: type) -> Algorithm:
    """Register ``state_class`` under the name its ``config_class`` declares as ``type``; return the entry.

    Registering the same pair again is a no-op (modules may be re-imported);
    another pair under a taken name is a ValueError.
    """
    from .algorithms.base import AlgorithmState
    from .config import HookConfig

    if not (isinstance(config_class, type) and issubclass(config_class, HookConfig)):
        raise TypeError(f"config_class must be a commhooks.config.HookConfig subclass, got {config_class!r}")
    if not (isinstance(state_class, type) and issubclass(state_class, AlgorithmState)):
        raise TypeError(f"state_class must be a commhooks.AlgorithmState subclass, got {state_class!r}")
    field = config_class.model_fields.get("type")
    name = None if field is None else field.default
    if not isinstance(name, str) or not name or name == "none":
        raise ValueError(f"{config_class.__name__} needs a field `type: Literal['<name>'] = '<name>'` (not 'none')")
    entry = Algorithm(name, config_class, state_class)
    known = _ALGORITHMS.get(name)
    if known is not None and known != entry:
        raise ValueError(f"an algorithm named {name!r} is already registered ({known.state_class.__qualname__})")
    _ALGORITHMS[name] = entry
    state_class.config_class = config_class
    state_class.name = name
    return entry


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        from . import algorithms  # noqa: F401  (registers qsr and ab)


def algorithms() -> List[Algorithm]:
    """Every registered algorithm, built-ins first."""
    _load_builtins()
    return list(_ALGORITHMS.values())


def names() -> List[str]:
    return [a.name for a in algorithms()]


def get(name: str) -> Algorithm:
    """The algorithm registered as ``name``; KeyError listing the known names otherwise."""
    _load_builtins()
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"no algorithm {name!r} is registered; known: {', '.join(_ALGORITHMS)}") from None


def for_config(config) -> Algorithm:
    """The algorithm a validated config object belongs to."""
    return get(config.kind)
