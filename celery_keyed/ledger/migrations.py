"""The ledger owns its schema: versioned SQL migrations and the function that applies them.

``sql/migrations/NNNN_title.sql`` are applied in order, all in one transaction that holds a transaction-scoped
advisory lock, so that several workers (or a Django ``migrate`` and a worker) starting at once apply each exactly
once — through a transaction pooler too (PgBouncer in transaction mode hands each transaction to some server
connection: a session-level lock would be taken on one and released on another, or never).
``sql/schema.sql`` is the whole current schema for readers; tests/migration proves the two agree.
"""

from __future__ import annotations

import re
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

#: The migrations of the development versions before 0.1.0, squashed into 0001_initial for 0.1.0. A ledger that
#: recorded every one of them has 0.1.0's schema already; one that recorded only some of them was created by a
#: development version and is behind in a way no migration of 0.1.0 can know (``migrate`` refuses it).
PRE_RELEASE_VERSIONS = frozenset(
    {
        "0002_composition",
        "0003_books_retention",
        "0004_holder_liveness",
        "0005_server_paths",
        "0006_send_and_config_versions",
        "0007_release_and_promote",
        "0008_outbox",
        "0009_park_at_receipt",
        "0010_plpgsql_limits",
        "0011_debounce",
        "0012_readers_writers",
        "0013_generic_release_plans",
        "0014_key_overrides",
        "0015_newest_wins",
        "0016_fair_weights",
        "0017_sweep_indexes",
        "0018_hot_path_cost",
        "0019_admit_plain_many",
        "0020_keyed_limits",
        "0021_cached_plans",
        "0022_durable_batches",
        "0023_retry_outbox",
        "0024_shard_layouts",
        "0025_failover",
        "0026_canvas_message",
        "0027_group_policies",
        "0028_lost_books",
        "0029_held_groups",
        "0030_guard_reads_the_server_once",
        "0031_books_keep_every_key",
    }
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
        _check_not_pre_release(done)
        for version, sql in migration_files():
            if version in done:
                continue
            _execute_script(conn, sql)
            conn.execute(
                sa.text("INSERT INTO keyed_migrations (version, applied_at) VALUES (:v, now())"), {"v": version}
            )
            applied.append(version)
    return applied


def _check_not_pre_release(done: set[str]) -> None:
    """``SchemaMissing`` for a ledger created by a development version before 0.1.0 that did not apply all of its
    migrations (see ``PRE_RELEASE_VERSIONS``)."""
    seen = done & PRE_RELEASE_VERSIONS
    if seen and seen != PRE_RELEASE_VERSIONS:
        missing = sorted(PRE_RELEASE_VERSIONS - seen)
        raise SchemaMissing(
            "this ledger was created by a development version of celery-keyed before 0.1.0 and is behind it (it lacks"
            f" {', '.join(missing[:3])}{'…' if len(missing) > 3 else ''}); 0.1.0 squashed those migrations into its"
            " initial schema: remove the ledger (`celery -A <app> keyed drop-ledger --yes --force`, which drops what"
            " waits in it) and migrate again"
        )


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


# -- removing the ledger -------------------------------------------------------------------------------------------

#: An object the ledger's SQL creates: its kind and its name (every name is prefixed keyed_).
_CREATED = re.compile(
    r"\bCREATE\s+(?:OR\s+REPLACE\s+)?(?:UNIQUE\s+)?(TABLE|SEQUENCE|FUNCTION|PROCEDURE|VIEW|TYPE)\s+"
    r"(?:IF\s+NOT\s+EXISTS\s+)?(keyed_\w+)",
    re.IGNORECASE,
)


def ledger_objects() -> dict[str, set[str]]:
    """Kind (``table``, ``sequence``, ``function``, ``procedure``, ``view``, ``type``) -> the names of every object
    the ledger's schema and migrations create, with the migration runner's own table. Indexes, constraints and
    triggers go with their tables."""
    found: dict[str, set[str]] = {}
    for sql in [schema_sql(), *(sql for _, sql in migration_files())]:
        for kind, name in _CREATED.findall(sql):
            found.setdefault(kind.lower(), set()).add(name)
    found.setdefault("table", set()).add("keyed_migrations")
    return found


class LedgerInUse(RuntimeError):
    """The ledger still holds work (tasks waiting in it, slots held): dropping it would lose the waiting tasks."""

    def __init__(self, waiting: int, claims: int) -> None:
        self.waiting, self.claims = waiting, claims
        super().__init__(
            f"the ledger still holds work: {waiting} task(s) waiting in it (their messages live only there) and "
            f"{claims} slot(s) held; let them run first (see the docs: Removing celery-keyed), or force it"
        )


_HELD_WORK = sa.text(
    "SELECT (SELECT count(*) FROM keyed_waiting) AS waiting, (SELECT count(*) FROM keyed_claims) AS claims"
)

_PROCS_NAMED = sa.text(
    "SELECT p.oid::regprocedure::text AS signature, p.prokind::text AS kind FROM pg_proc p"
    " WHERE p.proname = :name AND p.pronamespace = current_schema()::regnamespace"
)


def drop_ledger(engine: sa.Engine, *, force: bool = False) -> list[str]:
    """Drop every object of the ledger from ``engine``'s database (``ledger_objects``: tables with their indexes,
    constraints and triggers, sequences, functions and procedures, the migration runner's table), in one
    transaction under the migrations' advisory lock; the objects dropped, as ``"kind name"``. Raises
    ``LedgerInUse`` (and drops nothing) while tasks wait in the ledger or slots are held, unless ``force``: the
    waiting tasks' messages live only there. Objects of other names are never touched."""
    objects = ledger_objects()
    dropped: list[str] = []
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        present = conn.execute(
            sa.text("SELECT to_regclass('keyed_waiting') IS NOT NULL AND to_regclass('keyed_claims') IS NOT NULL")
        ).scalar_one()
        if present and not force:
            held = conn.execute(_HELD_WORK).one()
            if held.waiting or held.claims:
                raise LedgerInUse(int(held.waiting), int(held.claims))
        for kind, statement in (("view", "DROP VIEW"), ("table", "DROP TABLE"), ("sequence", "DROP SEQUENCE")):
            for name in sorted(objects.get(kind, ())):
                exists = conn.execute(sa.text("SELECT to_regclass(:n) IS NOT NULL"), {"n": name}).scalar_one()
                if exists:
                    conn.execute(sa.text(f'{statement} "{name}" CASCADE'))
                    dropped.append(f"{kind} {name}")
        for name in sorted(objects.get("function", set()) | objects.get("procedure", set())):
            for proc in conn.execute(_PROCS_NAMED, {"name": name}).all():
                kind = "procedure" if proc.kind == "p" else "function"
                conn.execute(sa.text(f"DROP {kind.upper()} {proc.signature} CASCADE"))
                dropped.append(f"{kind} {proc.signature}")
        for name in sorted(objects.get("type", ())):
            exists = conn.execute(sa.text("SELECT to_regtype(:n) IS NOT NULL"), {"n": name}).scalar_one()
            if exists:
                conn.execute(sa.text(f'DROP TYPE "{name}" CASCADE'))
                dropped.append(f"type {name}")
    return dropped
