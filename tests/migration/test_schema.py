"""One owner for the schema (STYLE §5): ``sql/schema.sql`` applied to an empty database gives exactly the
catalog that every file of ``sql/migrations/`` applied in order gives; ``migrate`` is idempotent and safe to
run from several connections at once; every object the ledger creates carries the ``keyed_`` prefix.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_keyed.ledger import migrations
from celery_keyed.ledger.migrations import _MIGRATION_LOCK_ID, migrate, migration_files, schema_sql

# The bookkeeping table of the migration runner itself: it exists only where migrate() ran.
RUNNER_OBJECTS = {"keyed_migrations", "keyed_migrations_pkey"}

# Catalog queries over the current schema. Each returns rows of text so that two databases compare by value.
# Column order is left out on purpose: a later migration can only append a column, while schema.sql may list
# it where it reads best; the ledger names every column it reads or writes.
CATALOG: dict[str, str] = {
    "tables": """
        SELECT c.relname, c.relkind::text, c.relpersistence::text
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
    """,
    "columns": """
        SELECT table_name, column_name, data_type, udt_name, is_nullable,
               coalesce(column_default, ''), is_identity, coalesce(identity_generation, ''),
               coalesce(character_maximum_length::text, ''), coalesce(numeric_precision::text, '')
          FROM information_schema.columns
         WHERE table_schema = current_schema()
    """,
    "constraints": """
        SELECT cl.relname, con.conname, con.contype::text, pg_get_constraintdef(con.oid, true)
          FROM pg_constraint con
          JOIN pg_class cl ON cl.oid = con.conrelid
          JOIN pg_namespace n ON n.oid = con.connamespace
         WHERE n.nspname = current_schema()
    """,
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()
    """,
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = current_schema() AND p.proname LIKE 'keyed\\_%'
    """,
    "sequences": """
        SELECT sequencename, data_type::text, start_value::text, min_value::text, max_value::text,
               increment_by::text, cycle::text, cache_size::text
          FROM pg_sequences WHERE schemaname = current_schema()
    """,
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid, true)
          FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = current_schema() AND NOT t.tgisinternal
    """,
    "comments": """
        SELECT c.relname, coalesce(a.attname, ''), d.description
          FROM pg_description d
          JOIN pg_class c ON c.oid = d.objoid AND d.classoid = 'pg_class'::regclass
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = d.objsubid AND d.objsubid > 0
         WHERE n.nspname = current_schema()
    """,
}


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture
def other_blank_database_url(postgres_server: Any) -> Iterator[str]:
    """A second empty database (``blank_database_url`` gives one per test), dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_libpq(postgres_server.url), autocommit=True, connect_timeout=10) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield postgres_server.url_for(name)
    with psycopg.connect(_libpq(postgres_server.url), autocommit=True, connect_timeout=10) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def blank_engine(blank_database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(blank_database_url)
    yield engine
    engine.dispose()


def _apply_schema_file(engine: sa.Engine) -> None:
    """Apply sql/schema.sql as one script through the raw driver cursor, as migrations.py does."""
    with engine.connect() as conn, conn.begin():  # commits the driver's transaction the script ran in
        migrations._execute_script(conn, schema_sql())  # the runner's own way to run a script


def _catalog(engine: sa.Engine) -> dict[str, set[tuple[str, ...]]]:
    """Every catalog fact of the current schema, minus the migration runner's own table."""
    facts: dict[str, set[tuple[str, ...]]] = {}
    with engine.connect() as conn:
        for kind, query in CATALOG.items():
            rows = {tuple(str(v) for v in row) for row in conn.execute(sa.text(query))}
            facts[kind] = {row for row in rows if not RUNNER_OBJECTS.intersection(row[:2])}
    return facts


def test_migrations_exist_and_are_ordered() -> None:
    versions = [version for version, _ in migration_files()]
    assert versions, "no migration shipped in celery_keyed/ledger/sql/migrations/"
    assert versions == sorted(versions)
    assert all(v[:4].isdigit() and v[4] == "_" for v in versions), versions


def test_fresh_schema_equals_all_migrations_applied(blank_engine: sa.Engine, other_blank_database_url: str) -> None:
    _apply_schema_file(blank_engine)
    migrated = sa.create_engine(other_blank_database_url)
    try:
        assert migrate(migrated) == [version for version, _ in migration_files()]
        fresh, applied = _catalog(blank_engine), _catalog(migrated)
    finally:
        migrated.dispose()

    assert fresh["tables"], "schema.sql created no table"
    assert fresh["functions"], "schema.sql created no keyed_ function"
    differences = [
        f"{kind}:\n  only in schema.sql: {sorted(fresh[kind] - applied[kind])}"
        f"\n  only after migrations: {sorted(applied[kind] - fresh[kind])}"
        for kind in CATALOG
        if fresh[kind] != applied[kind]
    ]
    assert not differences, "schema.sql and the migrations differ:\n" + "\n".join(differences)


def test_migrate_is_idempotent(blank_engine: sa.Engine) -> None:
    everything = [version for version, _ in migration_files()]
    assert migrations.pending_versions(blank_engine) == everything
    assert migrate(blank_engine) == everything
    before = _catalog(blank_engine)
    assert migrate(blank_engine) == []
    assert migrations.pending_versions(blank_engine) == []
    assert _catalog(blank_engine) == before
    with blank_engine.connect() as conn:
        assert migrations.applied_versions(conn) == everything


def _advisory_waiters(conn: sa.Connection) -> int:
    """Sessions waiting for the migration runner's advisory lock (the lock id is split into two int4s)."""
    return int(
        conn.execute(
            sa.text("""SELECT count(*) FROM pg_locks
                    WHERE locktype = 'advisory' AND NOT granted AND database = (
                          SELECT oid FROM pg_database WHERE datname = current_database())
                      AND ((classid::bigint << 32) | objid::bigint) = :id"""),
            {"id": _MIGRATION_LOCK_ID},
        ).scalar_one()
    )


def test_concurrent_migrate_applies_each_version_once(blank_engine: sa.Engine) -> None:
    """Two threads call migrate() at once. The test holds the runner's advisory lock until both are seen
    waiting for it in pg_locks, so the two runs really overlap; then each version is applied exactly once."""
    everything = [version for version, _ in migration_files()]
    results: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            results[name] = migrate(blank_engine)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with blank_engine.connect() as holder:
        holder.execute(sa.text("SELECT pg_advisory_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        holder.commit()
        threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
        for t in threads:
            t.start()
        with blank_engine.connect() as observer:
            deadline = time.monotonic() + 10
            while _advisory_waiters(observer) < 2:
                assert time.monotonic() < deadline, "the two migrate() calls never both waited for the lock"
                time.sleep(0.01)
        holder.execute(sa.text("SELECT pg_advisory_unlock(:id)"), {"id": _MIGRATION_LOCK_ID})
        holder.commit()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive()

    assert not errors, errors
    assert sorted(results["a"] + results["b"]) == sorted(everything)
    assert [] in (results["a"], results["b"])  # the second run found everything applied
    with blank_engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT version, count(*) FROM keyed_migrations GROUP BY version")).all()
    assert sorted(rows) == [(version, 1) for version in sorted(everything)]


# Every object in the schema, by kind: relations (tables, indexes, sequences, views), constraints, functions,
# triggers and types (a table's row type is named after it).
OBJECTS = """
    SELECT 'relation ' || c.relkind::text, c.relname
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = current_schema()
    UNION ALL
    SELECT 'constraint', con.conname
      FROM pg_constraint con JOIN pg_namespace n ON n.oid = con.connamespace WHERE n.nspname = current_schema()
    UNION ALL
    SELECT 'function', p.proname
      FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = current_schema()
    UNION ALL
    SELECT 'trigger', t.tgname
      FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE n.nspname = current_schema() AND NOT t.tgisinternal
    UNION ALL
    SELECT 'type', t.typname
      FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = current_schema()
"""


@pytest.mark.parametrize("how", ["schema.sql", "migrate"])
def test_every_object_is_prefixed(blank_engine: sa.Engine, how: str) -> None:
    with blank_engine.connect() as conn:
        assert conn.execute(sa.text(OBJECTS)).all() == [], "the blank database is not empty"
    if how == "schema.sql":
        _apply_schema_file(blank_engine)
    else:
        migrate(blank_engine)
    with blank_engine.connect() as conn:
        objects = conn.execute(sa.text(OBJECTS)).all()
    kinds = {kind.split()[0] for kind, _ in objects}
    assert {"relation", "constraint", "function", "type"} <= kinds, kinds
    # Array types of tables are named _keyed_...; Postgres derives them, so the prefix follows the underscore.
    unprefixed = sorted((kind, name) for kind, name in objects if not name.lstrip("_").startswith("keyed_"))
    assert unprefixed == [], f"objects without the keyed_ prefix: {unprefixed}"


def test_a_ledger_of_a_development_version_is_kept_only_when_it_had_every_squashed_migration(
    blank_engine: sa.Engine,
) -> None:
    """0.1.0 squashed the development versions' migrations into 0001_initial. A ledger that recorded all of them has
    0.1.0's schema (nothing to apply); one that recorded only some is behind in a way no migration can know:
    ``migrate`` refuses it with what to do, and changes nothing."""
    from celery_keyed.ledger import SchemaMissing
    from celery_keyed.ledger.migrations import PRE_RELEASE_VERSIONS, migration_files

    migrate(blank_engine)
    assert "0002_composition" in PRE_RELEASE_VERSIONS and "0001_initial" not in PRE_RELEASE_VERSIONS
    record = sa.text("INSERT INTO keyed_migrations (version, applied_at) VALUES (:v, now())")
    with blank_engine.begin() as conn:
        for version in sorted(PRE_RELEASE_VERSIONS):
            conn.execute(record, {"v": version})
    assert migrate(blank_engine) == []  # every one of them: 0.1.0's schema, nothing to do
    with blank_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM keyed_migrations WHERE version >= '0020'"))
    with pytest.raises(SchemaMissing, match=r"development version of celery-keyed before 0\.1\.0"):
        migrate(blank_engine)
    with blank_engine.connect() as conn:
        recorded = conn.execute(sa.text("SELECT count(*) FROM keyed_migrations")).scalar_one()
    assert recorded == len(migration_files()) + 18
