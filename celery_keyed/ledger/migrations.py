"""The ledger owns its schema: versioned SQL migrations and the function that applies them.

``sql/migrations/NNNN_title.sql`` are applied in order, each in its own transaction, under an advisory lock so
that several workers (or a Django ``migrate`` and a worker) starting at once apply each exactly once.
``sql/schema.sql`` is the whole current schema for readers; tests/migration proves the two agree.
"""

from __future__ import annotations

from importlib import resources

import sqlalchemy as sa

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

    Safe to call from several processes at once: a session-level advisory lock serialises the runs and each
    migration commits together with its row in ``keyed_migrations``.
    """
    applied: list[str] = []
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        try:
            conn.execute(_CREATE_MIGRATIONS_TABLE)
            conn.commit()
            done = set(applied_versions(conn))
            for version, sql in migration_files():
                if version in done:
                    continue
                _execute_script(conn, sql)
                conn.execute(
                    sa.text("INSERT INTO keyed_migrations (version, applied_at) VALUES (:v, now())"),
                    {"v": version},
                )
                conn.commit()
                applied.append(version)
        finally:
            conn.rollback()
            conn.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": _MIGRATION_LOCK_ID})
            conn.commit()
    return applied
