"""The worker's seams (issue 13): the worker reaches the ledger only through ``Ledger``; celery_keyed's modules
import without a cycle (the header names live in headers.py, so messages.py and task.py no longer import each
other) and each imports alone in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_keyed"
LEDGER = PACKAGE / "ledger"

#: The worker: the gate (the composition) and its services.
WORKER_FILES = [PACKAGE / "gate.py", *sorted((PACKAGE / "worker").glob("*.py"))]

#: What a connection or an engine is used through; the worker calls none of them (Ledger does).
ENGINE_USES = {"connect", "begin", "raw_connection", "exec_driver_sql", "execution_options", "text"}


def _modules() -> dict[str, Path]:
    """celery_keyed's modules outside the ledger (which has its own test), by dotted name."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if LEDGER in path.parents or "__pycache__" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    return skipped


def _imports(path: Path, known: set[str]) -> set[str]:
    """celery_keyed modules ``path`` imports at run time, at any depth of the file (a function-level import counts:
    it closes a cycle as soon as the function runs); ``from package import module`` counts as the module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("celery_keyed"):
            modules = {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
            found |= modules or {node.module}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("celery_keyed")}
    return found


def test_the_worker_imports_the_ledger_only_through_its_facade() -> None:
    """gate.py and celery_keyed/worker/ import ``celery_keyed.ledger`` itself, never one of its modules (neither
    ``celery_keyed.ledger.books`` nor ``from celery_keyed.ledger import books``)."""
    submodules = {p.stem for p in LEDGER.glob("*.py") if p.stem != "__init__"}
    found = []
    for path in WORKER_FILES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("celery_keyed.ledger."):
                    found.append((path.name, node.module))
                elif node.module == "celery_keyed.ledger":
                    found += [(path.name, f"celery_keyed.ledger.{a.name}") for a in node.names if a.name in submodules]
            elif isinstance(node, ast.Import):
                found += [(path.name, a.name) for a in node.names if a.name.startswith("celery_keyed.ledger.")]
    assert found == []


def test_the_worker_uses_the_engine_only_through_the_ledger() -> None:
    """No connection, transaction or SQL of the worker's own: every database call is a ``Ledger`` method. The gate
    creates the engine it hands to ``Ledger`` and disposes of it at close; nothing else touches it."""
    found = []
    for path in WORKER_FILES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_USES:
                found.append((path.name, node.lineno, ast.unparse(node)))
            if isinstance(node, ast.Attribute) and node.attr in ("engine", "autocommit"):
                parent = parents.get(id(node))
                if isinstance(parent, ast.Attribute) and parent.attr != "dispose":
                    found.append((path.name, node.lineno, ast.unparse(parent)))
            if isinstance(node, ast.Name) and node.id == "create_ledger_engine" and path.name != "gate.py":
                found.append((path.name, node.lineno, node.id))
    assert found == []


def test_the_seam_checks_find_what_they_look_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from celery_keyed.ledger import books\nwith self.engine.connect() as conn: pass\n")
    tree = ast.parse(sample.read_text())
    assert any(isinstance(n, ast.Attribute) and n.attr == "connect" for n in ast.walk(tree))
    assert "celery_keyed.ledger.books" in _imports(sample, {"celery_keyed.ledger.books"})


def test_celery_keyed_has_no_import_cycle() -> None:
    """Outside the ledger, no module imports (at run time, at any depth) a module that imports it back: the one
    there was, messages.py -> task.py (header names) -> messages.py (republish), went with headers.py. Imports of
    the package itself (``from celery_keyed import metrics`` runs ``celery_keyed/__init__``) are not edges."""
    modules = _modules()
    graph = {name: _imports(path, set(modules)) - {"celery_keyed"} for name, path in modules.items()}
    graph.pop("celery_keyed")
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                cycles.append([*stack[stack.index(other) :], other])
            elif other in graph and not state.get(other):
                visit(other)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if not state.get(module):
            visit(module)
    assert cycles == []
    assert _imports(modules["celery_keyed.messages"], set(modules)) == {"celery_keyed.headers"}
    assert _imports(modules["celery_keyed.headers"], set(modules)) == set()


@pytest.mark.parametrize("module", sorted(_modules()))
def test_each_module_imports_alone_in_a_fresh_interpreter(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_the_header_names_are_the_same_everywhere() -> None:
    """task.py re-exports headers.py's names (tests, users and the pytest plugin import them from there)."""
    from celery_keyed import headers, task

    for name in ("HEADER_KEY", "HEADER_GROUP", "HEADER_GROUP_SEQ", "HEADER_SUPERSEDE", "HEADER_NONCE", "HEADER_COST"):
        assert getattr(task, name) == getattr(headers, name)
    assert set(headers.NOT_INHERITED) & set(headers.INHERITED) == set()
    assert set(headers.GATE_HEADERS) == {*headers.INHERITED, headers.HEADER_NONCE}
