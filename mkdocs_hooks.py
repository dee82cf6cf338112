"""mkdocs hooks of the documentation site (mkdocs.yml): the README is the site's home page.

The README stays the repository's front page; the site serves it as ``index.md`` (it is not copied into docs/, so
there is one text), with its links into ``docs/`` and the docs' links back to it rewritten for the site."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent


def on_files(files: Files, config: Any) -> Files:
    readme = File.generated(config, "index.md", content=(ROOT / "README.md").read_text(encoding="utf-8"))
    files.append(readme)
    return files


_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Links that leave the site: the README's into docs/ and the docs' back to the README point at the site's pages;
    a link to a file of the repository that is not a page (code, tests, the CHANGELOG) becomes its path as code."""
    here = Path(page.file.src_uri).parent
    pages = {f.src_uri for f in files.documentation_pages()}

    def fix(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if re.match(r"^(https?:|mailto:|#)", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        if page.file.src_uri == "index.md" and path.startswith("docs/"):
            path = path[len("docs/") :]
        elif path in ("../README.md", "README.md"):
            path = "index.md"
        resolved = posixpath.normpath(posixpath.join(here.as_posix(), path)) if path else page.file.src_uri
        if resolved in pages:
            return f"[{text}]({path}{'#' + anchor if anchor else ''})"
        return f"{text} (`{target}`)"

    return _LINK.sub(fix, markdown)
