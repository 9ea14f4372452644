"""The algorithm registry: one line per algorithm, looked up by every engine adapter and tool.

    commhooks.register_algorithm(MyConfig, MyState, traffic=my_traffic)

``MyConfig`` is a :class:`~commhooks.settings.HookConfig` subclass whose
``type`` field is ``Literal["my-name"]``; ``MyState`` a
:class:`~commhooks.algorithms.contract.AlgorithmState` subclass.  From then on
``{"type": "my-name", ...}`` works wherever a config is accepted: in
``commhooks.ddp.register``, the Horovod ``DistributedOptimizer``, the
DeepSpeed ``"comm_hook"`` section, ``commhooks train --config`` and
``commhooks schema``.  No adapter or tool names an algorithm; they ask this
module.

``traffic`` (optional) declares what a rank sends: ``my_traffic(config,
setting) -> Traffic`` (:mod:`commhooks.algorithms.traffic`), or
``"module:function"`` naming it (imported when first asked).  The meter
tests, ``commhooks plan`` and the docs read an algorithm's bytes from it.

The registry sits above the algorithms (it checks a state class against
:class:`~commhooks.algorithms.contract.AlgorithmState`) and below everything that
dispatches by name (:mod:`commhooks.config`, the adapters, the tools).  It
imports no algorithm to fill itself: the built-ins (``qsr``, then ``ab``) are
registered by the package's entry, ``commhooks/__init__.py``, which runs
before any ``commhooks`` module can be imported, so they are listed first.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Callable, Dict, List, Optional, Union

from .algorithms.contract import AlgorithmState
from .settings import ConfigError, HookConfig

_ALGORITHMS: Dict[str, "Algorithm"] = {}


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A registered algorithm: its name (the config's ``type``), config class, state class and traffic
    declaration (None: not declared)."""

    name: str
    config_class: type
    state_class: type
    traffic: Optional[Union[Callable, str]] = None

    def check_options(self, options: dict, who: str) -> None:
        """ConfigError naming the keyword arguments an adapter was handed beside the config that the state does
        not take (``who``: the adapter's function, for the message)."""
        unknown = [k for k in options if k not in inspect.signature(self.state_class.__init__).parameters]
        if unknown:
            raise ConfigError(f"{who}: {self.state_class.__name__} takes no {', '.join(map(repr, unknown))} "
                              "(options beside the config are the state's own keyword arguments, e.g. QSR's "
                              "outer_optimizer; config keys go in the config)")

    def declare_traffic(self, config, setting):
        """The :class:`~commhooks.algorithms.traffic.Traffic` of ``config`` in ``setting``; None if undeclared."""
        fn = self.traffic
        if fn is None:
            return None
        if isinstance(fn, str):
            module, attr = fn.split(":", 1)
            fn = getattr(importlib.import_module(module), attr)
        return fn(config, setting)


def register_algorithm(config_class: type, state_class: type,
                       traffic: Optional[Union[Callable, str]] = None) -> Algorithm:
    """Register ``state_class`` under the name its ``config_class`` declares as ``type``; return the entry.

    Registering the same pair again is a no-op (modules may be re-imported), or declares its ``traffic``;
    another pair under a taken name is a ValueError.
    """
    if not (isinstance(config_class, type) and issubclass(config_class, HookConfig)):
        raise TypeError(f"config_class must be a commhooks.config.HookConfig subclass, got {config_class!r}")
    if not (isinstance(state_class, type) and issubclass(state_class, AlgorithmState)):
        raise TypeError(f"state_class must be a commhooks.AlgorithmState subclass, got {state_class!r}")
    field = config_class.model_fields.get("type")
    name = None if field is None else field.default
    if not isinstance(name, str) or not name or name == "none":
        raise ValueError(f"{config_class.__name__} needs a field `type: Literal['<name>'] = '<name>'` (not 'none')")
    if traffic is not None and not (callable(traffic) or isinstance(traffic, str) and ":" in traffic):
        raise TypeError(f"traffic must be a function (config, setting) -> Traffic or 'module:function', "
                        f"got {traffic!r}")
    entry = Algorithm(name, config_class, state_class, traffic)
    known = _ALGORITHMS.get(name)
    if known is not None and (known.config_class, known.state_class) == (config_class, state_class):
        entry = known if traffic is None else entry  # the same pair again: a no-op, or its traffic declared now
    elif known is not None:
        raise ValueError(f"an algorithm named {name!r} is already registered ({known.state_class.__qualname__})")
    _ALGORITHMS[name] = entry
    state_class.config_class = config_class
    state_class.name = name
    return entry


def algorithms() -> List[Algorithm]:
    """Every registered algorithm, built-ins first."""
    return list(_ALGORITHMS.values())


def names() -> List[str]:
    return [a.name for a in algorithms()]


def get(name: str) -> Algorithm:
    """The algorithm registered as ``name``; KeyError listing the known names otherwise."""
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"no algorithm {name!r} is registered; known: {', '.join(_ALGORITHMS)}") from None


def for_config(config) -> Algorithm:
    """The algorithm a validated config object belongs to."""
    return get(config.kind)


def declared_traffic(config, setting):
    """What one rank sends under ``config`` (a validated config) in ``setting``, as its algorithm declares it;
    None when the algorithm declares nothing."""
    return for_config(config).declare_traffic(config, setting)
