"""The package's layers: no import cycle, and no import from a lower layer up.

Counted on grimp's import graph of ``commhooks``, which holds the imports inside functions as well as those at
module level: an import moved into a function to break a cycle still counts, so a cycle has to be undone, not
hidden.  Each module belongs to the layer of its longest prefix in :data:`LAYERS`; a module no entry covers
fails the test, so a new module is placed on purpose.  An import within a layer is allowed (``algorithms`` is
one layer), a cycle is not, anywhere.
"""

import importlib.util
from pathlib import Path

import grimp  # the `test` extra
import pytest

pytestmark = pytest.mark.xdist_group("test_layers")  # its module fixtures are built once, on one worker

PACKAGE = "commhooks"
PKG = Path(__file__).resolve().parents[1] / "hooks" / PACKAGE

# top to bottom: a module may import its own layer and the layers below it
LAYERS = [
    ("the package's entry (registers the built-in algorithms)", ["commhooks"]),
    ("the command line", ["commhooks.cli"]),
    ("tools", ["commhooks.tools"]),
    ("framework integrations", ["commhooks.integrations"]),
    ("engine adapters", ["commhooks.ddp", "commhooks.fsdp", "commhooks.horovod", "commhooks.deepspeed", "commhooks.torchft",
                         "commhooks.torchft_plan"]),
    ("checkpoints, Horovod's launcher", ["commhooks.checkpoint", "commhooks.checkpointer", "commhooks.commit",
                                          "commhooks.launch_horovod"]),
    ("config loading by type", ["commhooks.config"]),
    ("the registry", ["commhooks.registry"]),
    ("algorithms", ["commhooks.algorithms"]),
    ("payload codecs and compressed means", ["commhooks.payload"]),
    ("engine facts, the step clock", ["commhooks.facts", "commhooks.phases"]),
    ("collectives, the launcher", ["commhooks.comm", "commhooks.launch"]),
    ("where settings come from", ["commhooks.sources"]),
    ("shipped configs", ["commhooks.shipped"]),
    ("settings, version", ["commhooks.settings", "commhooks._version"]),
]


def _covers(prefix: str, module: str) -> bool:
    """``prefix`` names ``module`` or a package holding it; the package itself names only itself (otherwise it
    would cover every module, and a new one would never need placing)."""
    return module == prefix or (prefix != PACKAGE and module.startswith(prefix + "."))


def layer_of(module: str):
    """The index in :data:`LAYERS` (0 = top) of ``module``'s longest covering prefix; None if none covers it."""
    found = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
             if _covers(prefix, module)]
    return max(found)[1] if found else None


@pytest.fixture(scope="module")
def graph():
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and Path(spec.origin).resolve().parent == PKG, (
        f"grimp would read {spec and spec.origin}, not this checkout's {PKG} (put hooks/ first on PYTHONPATH)")
    return grimp.build_graph(PACKAGE, cache_dir=None)


def _imports(graph, module):
    return sorted(graph.find_modules_directly_imported_by(module))


def _file(module: str) -> str:
    path = PKG.parent.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return str(path.relative_to(PKG.parents[1]))


def _where(graph, importer: str, imported: str) -> str:
    details = graph.get_import_details(importer=importer, imported=imported)
    return "; ".join(f"{_file(importer)}:{d['line_number']}: {d['line_contents'].strip()}" for d in details)


def strongly_connected(graph):
    """The strongly connected components of the import graph with more than one module (each one a cycle or
    several), by Tarjan's algorithm written without recursion."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(_imports(graph, root)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            module, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(_imports(graph, nxt))))
                    break
                if nxt in on_stack:
                    low[module] = min(low[module], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_has_a_layer(graph):
    unplaced = sorted(m for m in graph.modules if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS in {__file__}): {', '.join(unplaced)}"


def test_every_layer_entry_names_a_module(graph):
    stale = [p for _, prefixes in LAYERS for p in prefixes if not any(_covers(p, m) for m in graph.modules)]
    assert not stale, f"LAYERS names modules that no longer exist: {', '.join(stale)}"


def test_no_import_cycle(graph):
    lines = []
    for component in strongly_connected(graph):
        members = set(component)
        lines.append(f"a cycle of {len(component)} modules: {', '.join(component)}")
        lines += [f"    {m} -> {n}: {_where(graph, m, n)}"
                  for m in component for n in _imports(graph, m) if n in members]
    assert not lines, "\n".join(lines)


def test_no_import_from_a_lower_layer_up(graph):
    upward = []
    for importer in sorted(graph.modules):
        below = layer_of(importer)
        for imported in _imports(graph, importer):
            above = layer_of(imported)
            if below is not None and above is not None and above < below:
                upward.append(f"{importer} ({LAYERS[below][0]}) imports {imported} ({LAYERS[above][0]}): "
                              f"{_where(graph, importer, imported)}")
    assert not upward, f"{len(upward)} import(s) from a lower layer up:\n" + "\n".join(upward)


PICTURES = PKG.parents[1] / "docs" / "pictures"


def _drawn(line: str):
    """The module names a picture line starts with (``ddp, horovod, deepspeed   engine adapters``)."""
    return [name.strip() for name in line.strip().split("   ")[0].split(",")]


def test_the_design_page_draws_these_layers(graph):
    """docs/pictures/layers.txt (docs/pages/design.md) lists LAYERS top to bottom, and its sublayers of the
    algorithms name modules that exist."""
    body = PICTURES.joinpath("layers.txt").read_text().splitlines()
    rows = body[body.index("top") + 1: body.index("bottom")]
    drawn = [_drawn(r) for r in rows if r.startswith("  ") and not r.startswith("   ")]
    assert drawn == [[p.split(".", 1)[1] if "." in p else p for p in prefixes] for _, prefixes in LAYERS]
    inner = [name for r in rows if r.startswith("     ") for name in _drawn(r)]
    assert inner and all(f"{PACKAGE}.algorithms.{name}" in graph.modules for name in inner), inner


def test_the_sync_picture_names_functions_where_they_are():
    """docs/pictures/sync.txt: each ``Class.method`` or function sits in the file the picture names (a path in the
    package), and the picture reads a sync through at most four files of algorithms and payloads (the trace test,
    tests/test_sync_trace.py, adds the two of comm: six)."""
    import ast
    import re

    defined = {}
    for line in PICTURES.joinpath("sync.txt").read_text().splitlines()[1:]:
        found = re.search(r"([A-Za-z_][\w.]*)\s+([\w/]+\.py)\b", line)
        if not found:
            continue
        name, file = found.groups()
        if file not in defined:
            tree = ast.parse((PKG / file).read_text())
            defined[file] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)} | {
                f"{c.name}.{m.name}" for c in tree.body if isinstance(c, ast.ClassDef)
                for m in c.body if isinstance(m, ast.FunctionDef)}
        assert name in defined[file], f"docs/pictures/sync.txt: {name} is not in {file}"
    assert 3 <= len(defined) <= 4, sorted(defined)


def test_the_algorithms_stay_readable():
    """The algorithms and their contract stay readable (issue #51): at most 4,300 lines in all, no module over 400
    lines, no class over 220 (today's largest sit well under it)."""
    import ast

    total, too_long = 0, []
    for path in sorted((PKG / "algorithms").rglob("*.py")):
        text = path.read_text()
        total += text.count("\n")
        if text.count("\n") > 400:
            too_long.append(f"{path.relative_to(PKG)}: {text.count(chr(10))} lines")
        too_long += [f"{path.relative_to(PKG)}: class {c.name}, {c.end_lineno - c.lineno + 1} lines"
                     for c in ast.walk(ast.parse(text)) if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno >= 220]
    assert total <= 4300 and not too_long, (total, too_long)


def _names_a_module(folder, name: str) -> bool:
    """Whether ``name`` is a module beside the others of ``folder`` (a file ``name.py`` or a package ``name/``)."""
    return folder is not None and ((folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file())


def _imported_from(path: Path, node):
    """The folder that holds the modules ``from <node's module> import x`` may name: the package imported from,
    or None when that is a module (a file's names are not modules) or a package outside commhooks (then asked of
    its import system)."""
    if node.level:
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
    elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
        base = PKG.parent
    else:
        return None
    target = base.joinpath(*node.module.split(".")) if node.module else base
    return target if (target / "__init__.py").is_file() else None


def _outside_module(module: str, name: str) -> bool:
    """``from module import name`` names a submodule of a package outside commhooks."""
    try:
        return importlib.util.find_spec(f"{module}.{name}") is not None
    except (ImportError, ValueError):
        return False


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: no other module imports it (``from .x import _y``),
    so a module can change its helpers without breaking a sibling.  What others use is public and documented
    as such.  Allowed: dunders (``__version__``), a private sibling module (``from . import _compat``,
    ``from ._version import ...``) and an alias that makes an imported public name private (``x as _x``)."""
    import ast

    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            folder = _imported_from(path, node)
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") or (name.startswith("__") and name.endswith("__")):
                    continue
                outside = not node.level and node.module != PACKAGE and not node.module.startswith(PACKAGE + ".")
                if _names_a_module(folder, name) or (outside and _outside_module(node.module, name)):
                    continue
                found.append(f"{path.relative_to(PKG.parents[1])}:{node.lineno}: from "
                             f"{'.' * node.level}{node.module or ''} import {name}")
    assert not found, (f"{len(found)} import(s) of another module's private name (make it public, or move it):\n"
                       + "\n".join(found))


# writes onto a third party's object that are its documented protocol, or patches of a framework's method
THIRD_PARTY_FIELDS = {"_step_supports_amp_scaling": "torch's GradScaler protocol for optimizers that scale",
                      "_load_optimizer_and_scheduler": "the Hugging Face Trainer's method, patched to resume",
                      "_client": "torchft 0.2.0 Manager's quorum client, wrapped so that a replica group heals whole "
                                 "from one live group (commhooks/torchft_plan.py)"}


def test_no_module_writes_another_objects_private_fields():
    """A collaborator's private fields are its own: no code assigns ``other._field`` (only ``self._field``), so a
    state's internals cannot be changed from another module behind its back (issue #51: the step hooks once wrote
    the state's ``_reduced`` and ``_end``).  Markers the package sets on a framework's objects are named
    ``_commhooks_*``; a third party's own protocol is listed in :data:`THIRD_PARTY_FIELDS`, with why."""
    import ast

    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for attr in (e for e in ast.walk(target) if isinstance(e, ast.Attribute)):
                    name, owner = attr.attr, attr.value
                    if (not name.startswith("_") or name.startswith("__") or name.startswith("_commhooks")
                            or name in THIRD_PARTY_FIELDS
                            or (isinstance(owner, ast.Name) and owner.id in ("self", "cls"))):
                        continue
                    found.append(f"{path.relative_to(PKG.parents[1])}:{node.lineno}: {ast.unparse(target)}")
    assert not found, "writes of another object's private field:\n" + "\n".join(found)
