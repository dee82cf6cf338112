"""The ledger package keeps its shape (docs/ledger.md, "Modules"): no import hidden in a function (it would hide a
cycle from the import-alone check of tests/unit/test_layers.py, as names -> overrides -> promote -> names once was),
no module over 600 lines, and a facade whose ``__all__`` is exactly what is imported from it."""

from __future__ import annotations

import ast
from pathlib import Path

import celery_keyed.ledger

ROOT = Path(__file__).resolve().parents[2]
LEDGER = ROOT / "celery_keyed" / "ledger"

#: Where the facade's callers live (tests included: they import the facade's names too).
CALLERS = ("celery_keyed", "django_app", "example_project", "bench", "tests")


def test_the_ledger_imports_at_module_level_only() -> None:
    nested = []
    for path in sorted(LEDGER.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(node) for node in tree.body}
        nested += [
            f"{path.name}:{node.lineno}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top
        ]
    assert nested == []


def test_no_ledger_module_over_600_lines() -> None:
    long = {path.name: n for path in LEDGER.glob("*.py") if (n := len(path.read_text().splitlines())) > 600}
    assert long == {}


def _facade_names_imported() -> set[str]:
    found = set()
    for folder in CALLERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if LEDGER in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == "celery_keyed.ledger":
                    found |= {a.name for a in node.names if not (LEDGER / f"{a.name}.py").exists()}
    return found


def test_the_facade_exports_what_its_callers_import() -> None:
    exported = set(celery_keyed.ledger.__all__)
    imported = _facade_names_imported()
    assert imported - exported == set(), "a caller imports a name the facade does not export"
    assert exported - imported == set(), "an exported name nobody imports: export it no more"
