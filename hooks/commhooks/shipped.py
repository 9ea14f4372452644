"""The configs that ship with commhooks (the repository's ``configs/``), found by name.

``load_config("qsr_mnist1d")`` works from any directory: a bare name (no
folder, no file of that name here) is looked up in the shipped folder.
Installed from a wheel or sdist they live in ``<prefix>/share/commhooks/configs``
(setup.cfg's ``data_files``); in a source checkout or an editable install,
in ``configs/`` beside ``hooks/``.  ``commhooks configs`` lists them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

from .settings import ConfigError


def config_dirs() -> List[Path]:
    """Where shipped configs are, first match wins: the source tree's, then the installed copy."""
    candidates = [Path(__file__).resolve().parents[2] / "configs", Path(sys.prefix) / "share" / "commhooks" / "configs"]
    return [d for d in candidates if d.is_dir()]


def shipped_configs() -> Dict[str, Path]:
    """Name (file stem) -> path of every shipped config."""
    found: Dict[str, Path] = {}
    for folder in config_dirs():
        for path in sorted(folder.glob("*.json")):
            found.setdefault(path.stem, path)
    return found


def is_bare_name(text: str) -> bool:
    """A name such as ``qsr_mnist1d`` (or ``qsr_mnist1d.json``): no folder part."""
    return "/" not in text and "\\" not in text and not Path(text).exists()


def find(name: str) -> Path:
    """The shipped config called ``name`` (with or without ``.json``); ConfigError listing them otherwise."""
    stem = name[:-5] if name.endswith(".json") else name
    configs = shipped_configs()
    if stem not in configs:
        raise ConfigError(f"config {name!r} is neither a file nor a shipped config; shipped: "
                          f"{', '.join(configs) or 'none found'} (`commhooks configs` lists them)")
    return configs[stem]
