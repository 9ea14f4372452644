"""The claims table: every figure the prose quotes, computed from the results file it came from.

    python docs/claims.py            # each claim: its figure in the prose, the value its source gives, ok / DIFFERS
    python docs/claims.py --check    # exit 1 on any difference or unsourced figure (tests/test_claims.py runs it)

Why (docs/pages/tools/measure.md): a rerun left the prose behind more than once (a baseline from another day, a 300-step
figure beside a 1000-step table).  So the figures of the measured sections are data, not text:

* ``docs/claims.toml`` lists each claim: the file and a phrase of the line that holds the figure, the figure as
  printed, its source (a JSON file under ``results/``), a Python expression over that file, and the format that
  prints it.  The expression sees ``r`` (the whole file), and for a benchmark's ``results.json`` ``m`` (its
  methods) and ``s`` (its setup).  A claim that divides figures of two runs names the second as ``source2``
  (``r2``, ``m2``, ``s2``) and its section must say so with its ``crosses`` phrase: one run, one commit is the rule.
* The measured sections sit between ``<!-- claims -->`` and ``<!-- /claims -->``.  Every figure there (a number
  with a decimal point, a ratio ``1.05x``, a percentage, a time or a size) must be a claim's figure on that line,
  or part of the set-up (``4 ranks``, ``100 Mbit/s``, ``1000 steps``, dates, paths): an unsourced figure fails.
* A table the results file generates is one ``[[table]]`` entry rather than a claim per cell: ``rows`` names the
  function that writes its rows (``module:function``, called with the parsed ``source`` and the entry's ``args``;
  an arg named ``*_dir`` is a path from the repository root),
  and each row it gives must stand, exactly, on one line of the file's claims sections; the figures on those
  lines are then sourced.  The docs quote the tool's own rows, so no cell is copied by hand.
* A comparison in a claims section ("on every seed", "within about", "faster than", "matches", ...:
  :data:`COMPARISONS`) is a claim's figure too: a value that prints the words from the data (``"on every seed" if
  all(...) else ...``), so the words change when the data do.  Paired intervals: ``t95(differences)``.
* A budget is not a measurement: it is worded as one ("a budget of 8 minutes") and stays outside the sections.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import tomllib
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "docs" / "claims.toml"
BEGIN, END = "<!-- claims -->", "<!-- /claims -->"

# a figure: a signed decimal, a ratio, a percentage, a time or a size (not a word's digits: int2, H100, 2310.14423)
FIGURE = re.compile(r"(?<![\w.])(?<![A-Za-z]-)(?:(?<!\d)[+-])?\d+(?:\.\d+)?(?:\s?(?:x|%|ms|s|min|MB|kB|GB))?"
                    r"(?!\w|\.\d)")
# the set-up a sentence states, not a measurement (removed before figures are looked for)
SETUP = [re.compile(p) for p in (
    r"`[^`]*`",  # code, config names, commands
    r"\]\([^)]*\)",  # link targets
    r"\d{4}-\d{2}-\d{2}",  # dates
    r"arXiv \d+\.\d+",
    r"(?<![\d.])\d+\s?(?:ranks?|nodes?|steps?|seeds?|GPUs?|cores?|Mbit/s|Gbit/s|bits?|repeats?|groups?|"
    r"parameters|variants?|runs?|elements?)\b",  # counts are whole: "12.5 steps" is a measurement
    r"\d+(?:\.\d+)? M parameters",  # the model's size
    r"\bseeds? \d+(?:\s?(?:[-/,]|and)\s?\d+)*",  # seeds 0-2, seeds 3/4/5
    r"\bperiods? (?:of )?\d+(?!\d|\.\d)(?:\s?(?:[-/,]|to|and)\s?\d+)*",
    r"\bevery \d+ steps",
    r"\brank \d+\b",
    r"\d+-(?:core|seed|rank|step|GPU|bit)s?\b",  # a 2-core machine, a 3-seed mean
    r"\b(?:[Ii]ssue|section|DESIGN section) #?\d+",
    r"95 % (?:bootstrap |t )?interval",
    r"\btorch \d+\.\d+(?:\.\d+)?(?: (?:and|to|or) \d+\.\d+)?",  # versions
    r"\bint\d\b|\btop-k\b|\bH ?= ?\d+",
    r"\b\d+ %(?= of each)",  # a top-k density, a setting
)]


def load() -> List[dict]:
    """The claims, one per file a figure appears in (``file`` may list several: the README and the docs' home)."""
    claims = []
    for c in tomllib.loads(TABLE.read_text())["claim"]:
        files = c["file"] if isinstance(c["file"], list) else [c["file"]]
        claims += [dict(c, file=f) for f in files]
    return claims


def load_tables() -> List[dict]:
    """The ``[[table]]`` entries, one per file (``file`` may list several)."""
    tables = []
    for t in tomllib.loads(TABLE.read_text()).get("table", []):
        files = t["file"] if isinstance(t["file"], list) else [t["file"]]
        tables += [dict(t, file=f) for f in files]
    return tables


def table_rows(entry: dict) -> List[str]:
    """The rows a ``[[table]]`` entry's function writes from its source today."""
    module, _, name = entry["rows"].partition(":")
    rows = getattr(importlib.import_module(module), name)
    args = {k: str(REPO / v) if k.endswith("_dir") else v for k, v in entry.get("args", {}).items()}  # from the root
    return [r.strip() for r in rows(json.loads((REPO / entry["source"]).read_text()), **args)]


def _names(path: str, suffix: str = "") -> Dict[str, object]:
    data = json.loads((REPO / path).read_text())
    names = {"r" + suffix: data}
    if isinstance(data, dict) and "methods" in data and "setup" in data:
        names.update({"m" + suffix: data["methods"], "s" + suffix: data["setup"]})
    return names


def t95(values) -> dict:
    """The mean of ``values`` and its 95 % Student-t interval (``mean``, ``lo``, ``hi``), for paired differences:
    ``t95([a - b for a, b in zip(x, y)])``."""
    sys.path.insert(0, str(REPO / "hooks"))
    from commhooks.tools.curves import t_interval

    mean, lo, hi = t_interval(list(values))
    return {"mean": mean, "lo": lo, "hi": hi}


# comparisons a reader acts on: in a claims section each must be a claim's computed figure on its line (a value
# that prints the words, e.g. "on every seed" or "on 2 of 5 seeds"), never prose written beside the numbers
COMPARISONS = re.compile(r"\b(?:on (?:every|each|all) seeds?|(?:with)?in about|faster than|slower than|"
                         r"better than|worse than|nearer|closer to|beats?|matches|on the curve|as (?:good|fast) as|"
                         r"equal to|no (?:better|worse)|outside the (?:seed )?noise|far outside)\b", re.I)


def value(claim: dict) -> str:
    """The claim's figure as its source gives it today."""
    names = _names(claim["source"])
    if "source2" in claim:
        names.update(_names(claim["source2"], "2"))
    # claims.toml is code, reviewed as code: eval without builtins keeps a typo from reaching the system, it is no
    # sandbox; the names are globals so a comprehension over m sees them
    got = eval(claim["value"], {"__builtins__": {"min": min, "max": max, "abs": abs, "sum": sum, "len": len,
                                                 "dict": dict, "all": all, "any": any, "zip": zip,
                                                 "t95": t95}, **names})
    return claim["format"].format(**got) if isinstance(got, dict) else claim["format"].format(got)


def sections(path: Path) -> List[Tuple[int, str, str]]:
    """(line number, line, the whole section's text) of every line inside the file's claims sections."""
    inside, found, current = False, [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() == BEGIN:
            inside, current = True, []
        elif line.strip() == END:
            inside = False
            text = "\n".join(line for _, line in current)
            found += [(k, line, text) for k, line in current]
        elif inside:
            current.append((n, line))
    if inside:
        raise ValueError(f"{path}: a {BEGIN} section is not closed")
    return found


def figures(line: str) -> List[str]:
    """The figures a line states, its set-up removed."""
    for pattern in SETUP:
        line = pattern.sub(" ", line)
    return [m.group(0).strip() for m in FIGURE.finditer(line)]


def check(root: Path = REPO, claims: List[dict] = None, tables: List[dict] = None) -> List[str]:
    """Every problem: a figure that differs from its source, a claim whose line is gone, a figure with no claim,
    a generated table's row missing or changed."""
    claims = load() if claims is None else claims
    tables = load_tables() if tables is None else tables
    problems, by_file, generated = [], {}, {}
    for t in tables:
        lines = [line.strip() for _, line, _ in sections(root / t["file"])]
        for row in table_rows(t):
            generated.setdefault(t["file"], set()).add(row)
            if lines.count(row) != 1:
                problems.append(f"{t['file']}: a row of the table {t['rows']} writes from {t['source']} is on "
                                f"{lines.count(row)} lines of the claims sections (need exactly 1; changed or "
                                f"missing?): {row[:120]}")
    for c in claims:
        by_file.setdefault(c["file"], []).append(c)
    for name, file_claims in by_file.items():
        lines = sections(root / name)
        for c in file_claims:
            where = [(n, line, text) for n, line, text in lines if c["line"] in line]
            if len(where) != 1:
                problems.append(f"{name}: claim {c['figure']!r}: its phrase {c['line']!r} is on {len(where)} lines "
                                "of the claims sections (need exactly 1)")
                continue
            n, line, text = where[0]
            want = value(c)
            if c["figure"] != want:
                problems.append(f"{name}:{n}: the claims table says {c['figure']!r}, {c['source']} gives {want!r}")
            if c["figure"] not in line:
                problems.append(f"{name}:{n}: the line does not say {c['figure']!r}: {line.strip()[:120]}")
            if "source2" in c and c.get("crosses", "\0") not in text:
                problems.append(f"{name}:{n}: {c['figure']!r} divides figures of two runs; its section must say "
                                f"so ({c.get('crosses')!r})")
    for name in sorted({c["file"] for c in claims} | set(sectioned(root))):
        claimed = {}
        for c in by_file.get(name, []):
            claimed.setdefault(c["line"], []).append(c["figure"])
        for n, line, _ in sections(root / name):
            if line.strip() in generated.get(name, ()):
                continue  # a row its results file writes: every figure on it is sourced
            # the figures the line's claims state, each read as the scan reads the line (an interval: three)
            stated = {g for phrase, figs in claimed.items() if phrase in line for f in figs for g in figures(f)}
            stated |= {g.lstrip("+-") for g in stated}
            for fig in figures(line):
                if fig not in stated and fig.lstrip("+-") not in stated:
                    problems.append(f"{name}:{n}: figure {fig!r} has no claim (docs/claims.toml), nor is it set-up: "
                                    f"{line.strip()[:120]}")
            said = [f for phrase, figs in claimed.items() if phrase in line for f in figs]
            for words in COMPARISONS.finditer(line):
                if not any(words.group(0) in f for f in said):
                    problems.append(f"{name}:{n}: the comparison {words.group(0)!r} is prose, not a claim: make it "
                                    f"a claim's computed figure on this line, or drop it: {line.strip()[:120]}")
    return problems


def sectioned(root: Path = REPO) -> List[str]:
    """The files with claims sections: README.md and the docs' pages."""
    files = [root / "README.md", *sorted((root / "docs" / "pages").rglob("*.md"))]
    return [str(f.relative_to(root)) for f in files if BEGIN in f.read_text()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 on any problem")
    args = p.parse_args(argv)
    for t in load_tables():
        print(f"table   {t['file']}: {len(table_rows(t))} rows <- {t['rows']}({t['source']})")
    for c in load():
        want = value(c)
        print(f"{'ok     ' if want == c['figure'] else 'DIFFERS'} {c['file']}: {c['figure']!r} <- {want!r}  "
              f"({c['source']})")
    problems = check()
    print("\n".join(problems) or "no problems")
    return 1 if problems and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
