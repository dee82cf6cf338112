"""The ledger owns its schema: versioned SQL migrations and the function that applies them.

``sql/migrations/NNNN_title.sql`` are applied in order, all in one transaction that holds a transaction-scoped
advisory lock, so that several workers (or a Django ``migrate`` and a worker) starting at once apply each exactly
once — through a transaction pooler too (PgBouncer in transaction mode hands each transaction to some server
connection: a session-level lock would be taken on one and released on another, or never).
``sql/schema.sql`` is the whole current schema for readers; tests/migration proves the two agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources

import sqlalchemy as sa

from celery_keyed.ledger.errors import SchemaMissing

#: What to run when the schema is missing or behind (the worker's and the CLI's error messages say it).
MIGRATE_HINT = "run `celery -A <app> keyed migrate` (or `python manage.py migrate` with the Django app)"

#: The table that records applied migrations.
keyed_migrations = sa.Table(
    "keyed_migrations",
    sa.MetaData(),
    sa.Column("version", sa.Text, primary_key=True),
    sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False),
)

#: Arbitrary constant advisory-lock id ("keyed" in ASCII) serialising migration runs.
_MIGRATION_LOCK_ID = 0x6B65796564

_CREATE_MIGRATIONS_TABLE = sa.text(
    "CREATE TABLE IF NOT EXISTS keyed_migrations ("
    " version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
)


def migration_files() -> list[tuple[str, str]]:
    """All migrations shipped with the package, as ``(version, sql)`` in the order they apply."""
    folder = resources.files("celery_keyed.ledger") / "sql" / "migrations"
    files = sorted(
        (entry.name, entry.read_text(encoding="utf-8")) for entry in folder.iterdir() if entry.name.endswith(".sql")
    )
    return [(name.removesuffix(".sql"), sql) for name, sql in files]


def schema_sql() -> str:
    """The whole current schema (``sql/schema.sql``)."""
    return (resources.files("celery_keyed.ledger") / "sql" / "schema.sql").read_text(encoding="utf-8")


def applied_versions(conn: sa.Connection) -> list[str]:
    """Versions already applied on ``conn``'s database (empty when the ledger was never migrated)."""
    exists = conn.execute(sa.text("SELECT to_regclass('keyed_migrations') IS NOT NULL")).scalar_one()
    if not exists:
        return []
    return list(conn.execute(sa.text("SELECT version FROM keyed_migrations ORDER BY version")).scalars())


def _execute_script(conn: sa.Connection, sql: str) -> None:
    """Run a multi-statement SQL script as is (no parameters, so ``%`` is the modulo operator)."""
    with conn.connection.dbapi_connection.cursor() as cursor:  # type: ignore[union-attr]
        cursor.execute(sql)


def pending_versions(engine: sa.Engine) -> list[str]:
    """Versions shipped with the package that the database does not have yet."""
    with engine.connect() as conn:
        done = set(applied_versions(conn))
    return [version for version, _ in migration_files() if version not in done]


def migrate(engine: sa.Engine) -> list[str]:
    """Apply every pending migration; return the versions applied now (empty when up to date).

    Safe to call from several processes at once, directly or through a transaction pooler: one transaction takes a
    transaction-scoped advisory lock (a later run waits for it, then finds the versions applied), applies every
    pending migration with its row in ``keyed_migrations``, and commits them together — or none of them.
    """
    applied: list[str] = []
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        conn.execute(_CREATE_MIGRATIONS_TABLE)
        done = set(applied_versions(conn))
        for version, sql in migration_files():
            if version in done:
                continue
            _execute_script(conn, sql)
            conn.execute(
                sa.text("INSERT INTO keyed_migrations (version, applied_at) VALUES (:v, now())"), {"v": version}
            )
            applied.append(version)
    return applied


#: SQLSTATEs of a schema that is missing or older than the code: undefined_table, undefined_column,
#: undefined_function. A missing table always means "migrate"; a missing column or function only when migrations
#: are pending (else it is a bug in a statement, and the database's own error says more).
_UNDEFINED_TABLE = "42P01"
_UNDEFINED_OBJECTS = {_UNDEFINED_TABLE, "42703", "42883"}


def schema_missing(exc: BaseException, engine: sa.Engine) -> SchemaMissing | None:
    """A clear :class:`SchemaMissing` for a database error raised because the ledger's schema is missing or
    behind this version (a table, column or function it lacks), saying which; None for any other error."""
    orig = getattr(exc, "orig", None)
    diag = getattr(orig, "diag", None)
    sqlstate = getattr(diag, "sqlstate", None)
    if sqlstate not in _UNDEFINED_OBJECTS:
        return None
    detail = getattr(diag, "message_primary", None) or str(orig).strip().splitlines()[0]
    try:
        with engine.connect() as conn:
            done = set(applied_versions(conn))
    except sa.exc.DBAPIError:
        done = set()
    pending = [version for version, _ in migration_files() if version not in done]
    if not done:
        return SchemaMissing(f"the ledger has no schema: {MIGRATE_HINT} ({detail})")
    if pending:
        return SchemaMissing(
            f"the ledger's schema is behind this version of celery-keyed (pending: {', '.join(pending)}):"
            f" {MIGRATE_HINT} ({detail})"
        )
    if sqlstate == _UNDEFINED_TABLE:
        return SchemaMissing(f"the ledger's schema is incomplete ({detail}): {MIGRATE_HINT}")
    return None


@contextmanager
def schema_required(engine: sa.Engine) -> Iterator[None]:
    """Turn "relation keyed_... does not exist" inside the block into :class:`SchemaMissing` (see
    ``schema_missing``); every other error passes unchanged. (A ledger engine raises it as an ``OperationalError``:
    to a worker a schema it cannot use is a ledger it cannot use, errors.infrastructure_fault.)"""
    try:
        yield
    except (sa.exc.ProgrammingError, sa.exc.OperationalError) as exc:
        missing = schema_missing(exc, engine)
        if missing is None:
            raise
        raise missing from None  # the message carries the database's own detail
