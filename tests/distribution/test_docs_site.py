"""The documentation site (mkdocs.yml) builds with warnings as errors: every page in the navigation exists, and every
link between the README and the pages resolves (a link to a page that moved fails the build, and so this test)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    mkdocs = str(Path(sys.executable).parent / "mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "celery-keyed" in home and "Quick start" in home  # the README is the home page
    for page in ("guide", "features", "settings", "cli", "guarantees", "upgrading", "django", "events", "contributing",
                 "testing", "production", "canvas", "metrics", "worker", "ledger", "benchmarks"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


#: What a user's page must not carry: the design's decision numbers (D1 … D21), the internal design document's sections
#: and our issue numbers. The docs say the thing itself.
INTERNAL_REFERENCES = re.compile(r"\bD\d{1,2}\b|DESIGN(?:\.md)? ?§|\bissue #?\d+", re.IGNORECASE)


def test_the_pages_speak_to_users_not_to_the_design_notes() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
        for page in pages
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if INTERNAL_REFERENCES.search(line)
    ]
    assert found == [], "\n".join(found)
