"""MkDocs hooks of the commhooks site (docs/mkdocs.yml):

* the dated benchmark runs (``results/<run>/README.md`` and their pictures) become pages of the site, so the
  docs link them where they live instead of copying their tables;
* ``<!-- commhooks:cli -->`` becomes each subcommand's ``-h`` output, made by running it (never stale);
* ``<!-- commhooks:traffic -->`` becomes what each shipped MNIST-1D config declares it sends (``commhooks plan
  --declarations``: the algorithms' own traffic declarations, which the meter tests hold them to).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
CLI = ("train", "bench", "curves", "plan", "faults", "table", "configs", "schema")


def on_files(files, config):
    for path in sorted((REPO / "results").glob("*/*")):
        if path.parent.name == "site" or not (path.name == "README.md" or path.suffix == ".png"):
            continue
        files.append(File(str(path.relative_to(REPO)), src_dir=str(REPO), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


TRAFFIC = ("plan", "--declarations", "--model", "cnn", "--nodes", "2", "--ranks-per-node", "2")


def on_page_markdown(markdown, page, config, files):
    if "<!-- commhooks:traffic -->" in markdown:
        configs = ",".join(str(p) for p in sorted((REPO / "configs").glob("*_mnist1d.json"))
                           if not p.name.startswith("ds_"))
        out = subprocess.run([sys.executable, "-m", "commhooks.cli", *TRAFFIC, "--config", configs],
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"commhooks plan --declarations failed: {out.stderr[-500:]}")
        markdown = markdown.replace("<!-- commhooks:traffic -->", out.stdout.strip())
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
