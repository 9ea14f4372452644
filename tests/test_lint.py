"""The linter `make test` runs first (.ci/test.sh) passes on the repository and fails on a planted error, with the
rules of pyproject.toml's ``[tool.ruff]`` (pyflakes's checks and syntax errors)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).parent / "ruff"
PARTS = ["hooks", "tests", "docs", "examples", ".ci"]


def _ruff(*args, cwd=REPO):
    assert RUFF.exists(), "ruff is missing: the test extra (setup.cfg) installs it"
    return subprocess.run([str(RUFF), "check", "--no-cache", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_repository_lints_clean():
    proc = _ruff(*PARTS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_a_planted_error_fails_the_lint(tmp_path):
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "planted.py").write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    proc = _ruff("planted.py", cwd=tmp_path)
    assert proc.returncode == 1 and "F401" in proc.stdout and "F821" in proc.stdout, proc.stdout
