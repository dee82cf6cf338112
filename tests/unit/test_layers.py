"""The layers of DESIGN §4 import only what is below them. Which module may import which is kept by the
import-linter contracts (.importlinter, run by ``make test`` and ``make lint``); this file keeps what they cannot
see: the public API imports, no SQL outside the ledger, the ledger reached through its facade, and no import
cycle inside the ledger."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path


def _modules_after(import_line: str) -> set[str]:
    code = f"import sys; {import_line}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {name.split(".")[0] for name in out.split()}


def test_the_public_api_is_importable() -> None:
    loaded = _modules_after("from celery_keyed import keyed_task, KeyedTask, install, KeyedRejected")
    assert "celery" in loaded


# -- the ledger is the only seam (DESIGN §4, STYLE "Where the layout is going") ------------------------------------

ROOT = Path(__file__).resolve().parents[2]
LEDGER = ROOT / "celery_keyed" / "ledger"

#: Where the layers above the ledger live. tests/ and bench/ are not scanned for SQL: they read and write rows
#: behind the ledger's back on purpose (fixtures, races, observers independent of the ledger, the raw baseline of
#: the benchmarks), and tests may import ledger modules to test them. example_project/ is scanned for imports only:
#: its demo observer counts rows with its own queries to check the ledger's answers.
ABOVE_THE_LEDGER = ("celery_keyed", "django_app")
IMPORTERS = ("celery_keyed", "django_app", "example_project", "bench")

#: SQL outside the ledger that stays, each with why. Everything else goes through celery_keyed.ledger.
SQL_EXCEPTIONS = {
    # The throwaway servers' readiness probes (PostgreSQL's and PgBouncer's; psycopg, before any ledger exists): not
    # ledger statements.
    ("celery_keyed/testing/postgres.py", "SELECT 1"): 1,
    ("celery_keyed/testing/pgbouncer.py", "SELECT 1"): 1,
    # The test bed's standby (failover tests): replication state and controls of the server, not ledger statements.
    ("celery_keyed/testing/replica.py", "SELECT pg_reload_conf()"): 2,
    ("celery_keyed/testing/replica.py", "SELECT sync_state FROM pg_stat_replication"): 1,
    ("celery_keyed/testing/replica.py", "SELECT pg_current_wal_insert_lsn()::text"): 1,
    ("celery_keyed/testing/replica.py", "SELECT count(*) FROM pg_stat_wal_receiver"): 1,
    ("celery_keyed/testing/replica.py", "SELECT pg_is_in_recovery()"): 1,
    ("celery_keyed/testing/replica.py", "SELECT pg_last_wal_replay_lsn() >= '"): 1,
    ("celery_keyed/testing/replica.py", "SELECT pg_promote(true,"): 1,
}

#: Ledger modules imported directly from outside it, each with why (to be routed through celery_keyed.ledger).
IMPORT_EXCEPTIONS = {
    # The Django app (being reworked: admin split, keyed_limits): all of these are exported by celery_keyed.ledger
    # except force_release.
    ("django_app/celery_keyed_django/ledger.py", "celery_keyed.ledger.bounds"),
    ("django_app/celery_keyed_django/schema.py", "celery_keyed.ledger.migrations"),
    ("django_app/celery_keyed_django/admin/claims.py", "celery_keyed.ledger.admin_queries"),
    ("django_app/celery_keyed_django/forms.py", "celery_keyed.ledger.bounds"),
    ("django_app/celery_keyed_django/forms.py", "celery_keyed.ledger.errors"),
    ("django_app/celery_keyed_django/forms.py", "celery_keyed.ledger.keyspec"),
}

_SQL_START = re.compile(r"^\s*(SELECT|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|WITH\s+\w+\s+AS)\b")


def _python_files(*folders: str) -> list[Path]:
    files = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if LEDGER in path.parents or "migrations" in path.parts or "__pycache__" in path.parts:
                continue
            files.append(path)
    return files


def _sql_in(path: Path) -> list[str]:
    """SQL found in a module: sa.text()/text() calls, exec_driver_sql(), and string constants that read as SQL."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    counted: set[int] = set()  # constants already found as the argument of a call
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("text", "exec_driver_sql") and node.args:
                arg = node.args[0]
                counted.add(id(arg))
                found.append(arg.value if isinstance(arg, ast.Constant) else f"{name}(<expression>)")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in counted
            and _SQL_START.match(node.value)
        ):
            found.append(node.value)
    return found


def test_no_sql_outside_the_ledger() -> None:
    seen: dict[tuple[str, str], int] = {}
    for path in _python_files(*ABOVE_THE_LEDGER):
        for sql in _sql_in(path):
            where = (str(path.relative_to(ROOT)), " ".join(str(sql).split()))
            seen[where] = seen.get(where, 0) + 1
    unexpected = {where: n for where, n in seen.items() if where not in SQL_EXCEPTIONS}
    assert unexpected == {}, "SQL belongs in celery_keyed/ledger/ (a named statement of its table's module)"
    # An exception that is gone must leave the list too, so the list stays true.
    assert {where: n for where, n in seen.items() if where in SQL_EXCEPTIONS} == SQL_EXCEPTIONS


def test_the_sql_check_finds_sql() -> None:
    sample = ROOT / "celery_keyed" / "ledger" / "claims.py"
    assert any("keyed_claims" in sql for sql in _sql_in(sample))


def _ledger_imports(path: Path) -> set[str]:
    """Ledger modules (celery_keyed.ledger.<module>) a file imports, at any depth of the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("celery_keyed.ledger."):
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.startswith("celery_keyed.ledger.")}
    return modules


def test_nothing_above_the_ledger_imports_a_ledger_module() -> None:
    """The layers above import the ledger through celery_keyed.ledger (Ledger and its exports) only."""
    found = {
        (str(path.relative_to(ROOT)), module)
        for path in _python_files(*IMPORTERS)
        for module in _ledger_imports(path)
    }
    assert found - IMPORT_EXCEPTIONS == set()
    assert IMPORT_EXCEPTIONS - found == set(), "an exception that is gone must leave the list"


def test_the_ledger_package_has_no_import_cycle() -> None:
    """Each ledger module imports only modules below it: importing any one of them first works."""
    for path in sorted(LEDGER.glob("*.py")):
        module = f"celery_keyed.ledger.{path.stem}" if path.stem != "__init__" else "celery_keyed.ledger"
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True, cwd=ROOT)
