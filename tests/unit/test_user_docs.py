"""What a user reads — the README and the ``celery keyed`` help — says things in the project's own words: no
references to internal design notes (``D3``, ``§3.1``, ``DESIGN.md``) a user cannot follow (issue 10, defect 4),
and the Quick start declares tasks without publishing any (defect 3)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from celery_keyed.cli import keyed

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

#: A decision number (D1..D99), a section sign, or the design document: notes only the project's authors have.
DANGLING = re.compile(r"\bD\d{1,2}\b|§|DESIGN\.md")


def python_blocks(markdown: str, heading: str) -> list[str]:
    """The ```python blocks of one ``## heading`` section."""
    start = markdown.index(f"\n## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    section = markdown[start : end if end != -1 else None]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_has_no_dangling_references() -> None:
    found = [(n, line) for n, line in enumerate(README.splitlines(), 1) if DANGLING.search(line)]
    assert found == []


@pytest.mark.parametrize("command", ["", "status", "explain", "set-limit", "clear-limit", "reconcile", "migrate"])
def test_cli_help_has_no_dangling_references(command: str) -> None:
    result = CliRunner().invoke(keyed, [*command.split(), "--help"])
    assert result.exit_code == 0, result.output
    assert not DANGLING.search(result.output), result.output


def test_quick_start_module_publishes_nothing_at_import() -> None:
    """The module of the Quick start only declares: no statement at its top level calls a task."""
    module = python_blocks(README, "Quick start")[0]
    for node in ast.parse(module).body:
        if isinstance(node, ast.Expr | ast.Assign) and isinstance(node.value, ast.Call):
            call = ast.unparse(node.value.func)
            assert not call.endswith((".delay", ".apply_async", ".send_task", ".apply")), ast.unparse(node)


def test_install_section_names_the_extras_and_the_ledger_database() -> None:
    start = README.index("\n## Install\n")
    section = README[start : README.index("\n## ", start + 1)]
    assert "celery-keyed[redis]" in section
    assert "celery -A proj keyed migrate" in section
    assert "must exist" in section
