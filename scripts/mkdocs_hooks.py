"""MkDocs hooks of the documentation site (mkdocs.yml `hooks:`).

`<!-- include: PATH -->` on a page is replaced by the repository file PATH (relative to the
repository root), without its title, its headings one level down and its links into `docs/` made relative to the
site, so that config/README.md is one file, read on GitHub and in the site alike."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.M)


def _demote(text: str) -> str:
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            line = "#" + line
        out.append(line)
    return "\n".join(out) + "\n"


def _included(match: re.Match) -> str:
    text = (REPO / match.group(1)).read_text()
    if text.startswith("# "):  # the page gives the section its own heading
        text = text.partition("\n")[2]
    return _demote(text).replace("](../docs/", "](")


def on_page_markdown(markdown, page, config, files):
    return INCLUDE.sub(_included, markdown)


def on_serve(server, config, builder):
    server.watch(str(REPO / "config" / "README.md"))
    return server
