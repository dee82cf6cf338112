"""Clear errors, never a raw database error (issue 9 item 9), on real Postgres: numbers past the ledger's column
types, a database without the schema (or behind this version), and the largest values that are accepted working
end to end (no timestamp overflow on the first waiting task)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from celery import Celery

import celery_keyed
from celery_keyed.ledger import Arrival, InvalidConfig, Ledger, NameConfig, SchemaMissing, Verdict
from celery_keyed.ledger.bounds import SECONDS_MAX, SLOT_LIMIT_MAX
from celery_keyed.publisher import close_publisher
from celery_keyed.settings import read_settings


@pytest.fixture
def app(database_url: str) -> Iterator[Celery]:
    app = Celery("clear-errors", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    yield app
    close_publisher(app)
    app.close()


@pytest.fixture
def blank_engine(blank_database_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(blank_database_url)
    yield engine
    engine.dispose()


def _overrides(engine: sa.Engine) -> list[tuple[object, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT name, slot_limit FROM keyed_overrides"))]


@pytest.mark.parametrize("limit", [10**12, 2**63, 2**31, -1, 1.5, "3", True])
def test_an_override_past_the_limit_column_is_a_clear_error_naming_its_range(
    ledger: Ledger, engine: sa.Engine, app: Celery, limit: object
) -> None:
    """Before: 10**12 and 2**63 reached Postgres (NumericValueOutOfRange / DataError)."""
    message = rf"api: an override limit must be a non-negative integer \(0 pauses\), at most {SLOT_LIMIT_MAX}"
    with pytest.raises(InvalidConfig, match=message):
        ledger.set_override("api", limit, reason="x")  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match=message):
        celery_keyed.set_limit(app, "api", limit, reason="x")  # type: ignore[arg-type]
    with engine.begin() as conn, pytest.raises(InvalidConfig, match=message):
        celery_keyed.set_limit(app, "api", limit, reason="x", connection=conn)  # type: ignore[arg-type]
    assert _overrides(engine) == []


def test_the_largest_limit_is_stored(ledger: Ledger, engine: sa.Engine) -> None:
    ledger.set_override("api", SLOT_LIMIT_MAX, reason="x")
    assert _overrides(engine) == [("api", SLOT_LIMIT_MAX)]


def test_the_longest_max_wait_parks_and_expires_without_overflow(ledger: Ledger, clock) -> None:
    """The bound on durations (100 years) keeps arrival + max_wait a timestamp Postgres and Python both hold:
    max_wait=1e300 used to be stored, then the first waiting task died with a timestamp overflow."""
    config = NameConfig("slow", limit=1, max_wait=SECONDS_MAX, uncertain_hold=SECONDS_MAX)
    ledger.configure({"slow": config}, now=clock())
    assert ledger.admit(Arrival("a", key="slow:1"), now=clock()).verdict is Verdict.ADMITTED
    assert ledger.admit(Arrival("b", key="slow:1", message={"id": "b"}), now=clock()).verdict is Verdict.PARKED
    explanation = ledger.explain("b", now=clock())
    assert explanation.state == "waiting"
    assert ledger.sweep(now=clock.advance(3600)).expired == 0


def test_a_ledger_without_the_schema_says_to_migrate(blank_engine: sa.Engine) -> None:
    """Before: a raw ``UndefinedTable`` from the worker's first ledger calls, with no hint."""
    ledger = Ledger(blank_engine, holder="h:1:x")
    for call in (ledger.register_holder, lambda: ledger.configure({"api": NameConfig("api", limit=2)}), ledger.books):
        with pytest.raises(SchemaMissing, match=r"the ledger has no schema: run `celery -A <app> keyed migrate`"):
            call()
    with pytest.raises(SchemaMissing, match="keyed migrate"):
        ledger.set_override("api", 2, reason="x")
    with pytest.raises(SchemaMissing, match="keyed migrate"):
        ledger.reconcile()


def test_a_ledger_behind_this_version_names_the_pending_migrations(
    blank_engine: sa.Engine, ledger_of_an_older_release: Callable[[sa.Engine], list[str]]
) -> None:
    pending = ", ".join(ledger_of_an_older_release(blank_engine))  # as an older release would have left it
    ledger = Ledger(blank_engine, holder="h:1:x")
    behind = rf"behind this version of celery-keyed \(pending: {pending}\)"
    with pytest.raises(SchemaMissing, match=behind):  # a worker's first call: holders gained a column since
        ledger.register_holder()
    with pytest.raises(SchemaMissing, match=behind):
        ledger.reconcile()
    from celery_keyed.ledger import migrate

    assert migrate(blank_engine) == pending.split(", ")  # then the ledger works
    ledger.register_holder()
    ledger.reconcile()


def test_a_worker_on_a_database_without_the_schema_fails_at_start_saying_to_migrate(blank_database_url: str) -> None:
    """The gate's start() makes the ledger's first calls (register_holder, configure): the ledger's domain error
    reaches the worker as is, so the worker stops at start with the hint instead of a raw UndefinedTable."""
    from celery_keyed.gate import GateService

    app = Celery("clear-errors", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = blank_database_url
    consumer = SimpleNamespace(hostname="clear-errors", timer=None, strategies={}, pool=None)
    gate = GateService(app, consumer, read_settings(app.conf))
    try:
        with pytest.raises(SchemaMissing, match="keyed migrate"):
            gate.start()
    finally:
        gate.shutdown()
        gate.engine.dispose()
        app.close()


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"keyed_database_url": "sqlite:///ledger.db"}, "keyed_database_url must be a PostgreSQL URL"),
        ({"keyed_database_url": "mysql://u@db/app"}, "got a 'mysql' URL"),
        ({"keyed_concurrency_limits": {"acct": {"max_wait": 1e300}}}, "acct: max_wait must be a positive number"),
        ({"keyed_lease": float("inf")}, "keyed_lease must be a positive number of seconds"),
    ],
)
def test_operator_calls_on_a_bad_configuration_say_what_is_wrong(
    database_url: str, conf: dict[str, object], message: str
) -> None:
    """``set_limit`` / ``clear_limit`` / ``revoke`` and the beat task raise the configuration's own error (before:
    ModuleNotFoundError for mysql, or "keyed_database_url is not configured" for any bad setting)."""
    from celery_keyed import beat

    app = Celery("clear-errors", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.update(conf)
    try:
        with pytest.raises(InvalidConfig, match=message):
            celery_keyed.set_limit(app, "api", 2, reason="x")
        with pytest.raises(InvalidConfig, match=message):
            celery_keyed.clear_limit(app, "api")
        with pytest.raises(InvalidConfig, match=message):
            beat.reconcile(app)
    finally:
        close_publisher(app)
        app.close()
