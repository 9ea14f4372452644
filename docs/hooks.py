"""MkDocs hooks of the commhooks site (docs/mkdocs.yml):

* the dated benchmark runs (``results/<run>/README.md`` and their pictures) become pages of the site, so the
  docs link them where they live instead of copying their tables;
* ``<!-- commhooks:cli -->`` becomes each subcommand's ``-h`` output, made by running it (never stale).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
CLI = ("train", "bench", "plan", "table", "configs", "schema")


def on_files(files, config):
    for path in sorted((REPO / "results").glob("*/*")):
        if path.parent.name == "site" or not (path.name == "README.md" or path.suffix == ".png"):
            continue
        files.append(File(str(path.relative_to(REPO)), src_dir=str(REPO), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    if "<!-- commhooks:cli -->" not in markdown:
        return markdown
    parts = []
    for command in CLI:
        out = subprocess.run([sys.executable, "-m", "commhooks.cli", command, "-h"], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"commhooks {command} -h failed: {out.stderr[-500:]}")
        parts.append(f"## `commhooks {command}`\n\n```text\n{out.stdout.strip()}\n```\n")
    return markdown.replace("<!-- commhooks:cli -->", "\n".join(parts))
