"""bench.scale's ledgers: the durable server, fresh migrated databases with the benchmark's names, and the
filler that writes the rows ``Ledger.admit`` writes when it parks, in bulk."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_keyed.ledger import Ledger, NameConfig, migrate

SMOKE = "Smoke, machine shared: not evidence"

FILL_NAME = "fill"  # paused (limit 0): its parked attempts never start
MEAS_NAME = "meas"
NAMES = {FILL_NAME: NameConfig(FILL_NAME, limit=0), MEAS_NAME: NameConfig(MEAS_NAME, limit=1)}
NOT_DUE_EVERY = 10  # 1 filler row in 10 has a not-before time a day ahead
SHALLOW = 10  # real parked attempts behind meas:0
MESSAGE_PAD = 200  # bytes of padding in a filler message (a small Celery message)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- servers and databases ---------------------------------------------------------------------------------------


@dataclass
class Server:
    url: str  # SQLAlchemy URL of the server's default database
    admin: str  # libpq URL, for CREATE / DROP DATABASE
    target: Any
    made: list[str] = field(default_factory=list)

    def database(self, tag: str) -> str:
        """A new migrated database with the benchmark's names configured; its SQLAlchemy URL."""
        name = f"keyed_scale_{tag}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(self.admin, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        self.made.append(name)
        url = self.target.url_for(name)
        engine = sa.create_engine(url)
        try:
            migrate(engine)
            Ledger(engine).configure(NAMES)
        finally:
            engine.dispose()
        return url

    def drop_all(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as admin:
            for name in self.made:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def server() -> Iterator[tuple[Server, str]]:
    from celery_keyed.testing import start_postgres

    with start_postgres(durable=True) as pg:
        admin = make_url(pg.url).set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(admin, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            fsync = conn.execute("SHOW fsync").fetchone()
            buffers = conn.execute("SHOW shared_buffers").fetchone()
        described = (f"PostgreSQL {version[0] if version else '?'} (fsync={fsync[0] if fsync else '?'}, "
                     f"shared_buffers={buffers[0] if buffers else '?'}, "
                     f"{'started by the benchmark' if pg.managed else 'KEYED_DATABASE_URL'})")
        srv = Server(pg.url, admin, pg)
        try:
            yield srv, described
        finally:
            srv.drop_all()


# -- the filler: the rows Ledger.admit writes when it parks, in bulk ----------------------------------------------

_FILL_TASKS = sa.text(
    """
    INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at)
    SELECT :prefix || g, 'bench.fill', {key}, NULL, now()
      FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g
    """
)
_FILL_WAITING = sa.text(
    """
    INSERT INTO keyed_waiting (task_id, attempt, key, group_key, group_seq, priority, arrival, arrived_at,
                               not_before, deadline, supersede_key, shadow, group_blocked, queue, message, keys,
                               cost, reserved_keys, reserved_shards, reserved_at, fair_key)
    SELECT :prefix || g, 0, {key}, NULL, NULL, 0, nextval('keyed_arrival_seq'), now(),
           CASE WHEN g % CAST(:not_due_every AS bigint) = 0 THEN now() + interval '1 day' END, NULL, NULL, false,
           false, 'celery',
           jsonb_build_object('task', 'bench.fill', 'id', :prefix || g, 'args', jsonb_build_array(g),
                              'kwargs', '{}'::jsonb,
                              'headers', jsonb_build_object('pad', repeat('x', CAST(:pad AS integer)))),
           NULL, 1, NULL, NULL, NULL, NULL
      FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g ORDER BY g
    """
)
# The head rows and slot rows of the filled keys, and their waiting counters (added to what real parks counted).
_FILL_KEYS = sa.text(
    """
    INSERT INTO keyed_keys (key, name, waiting, active_at)
    SELECT key, split_part(key, ':', 1), count(*), now() FROM keyed_waiting
     WHERE task_id LIKE :prefix || '%' GROUP BY key
    ON CONFLICT (key) DO UPDATE SET waiting = keyed_keys.waiting + excluded.waiting
    """
)
_FILL_SLOTS = sa.text(
    """
    INSERT INTO keyed_slots (key, shard, name, used)
    SELECT DISTINCT key, 0, split_part(key, ':', 1), 0 FROM keyed_waiting WHERE task_id LIKE :prefix || '%'
    ON CONFLICT (key, shard) DO NOTHING
    """
)


def fill(engine: sa.Engine, segments: list[tuple[str, int]], *, chunk: int = 100_000) -> float:
    """Park filler attempts in bulk: ``segments`` = (SQL expression of ``g`` giving the key, rows). Returns the
    seconds it took (then VACUUM ANALYZE, as autovacuum would have done on a ledger that grew this large)."""
    started = time.monotonic()
    prefix = f"fill-{uuid.uuid4().hex[:6]}-"
    lo = 1
    with engine.begin() as conn:
        for key_sql, rows in segments:
            for start in range(lo, lo + rows, chunk):
                params = {"prefix": prefix, "lo": start, "hi": min(lo + rows, start + chunk) - 1,
                          "not_due_every": NOT_DUE_EVERY, "pad": MESSAGE_PAD}
                conn.execute(sa.text(_FILL_TASKS.text.replace("{key}", key_sql)), params)
                conn.execute(sa.text(_FILL_WAITING.text.replace("{key}", key_sql)), params)
            lo += rows
        conn.execute(_FILL_KEYS, {"prefix": prefix})
        conn.execute(_FILL_SLOTS, {"prefix": prefix})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE keyed_waiting, keyed_tasks, keyed_keys, keyed_slots"))
    return time.monotonic() - started


def spread_key(keys: int) -> str:
    return f"'{FILL_NAME}:' || (g % {keys})"


def check_books(engine: sa.Engine) -> tuple[int, int, list[str]]:
    """(parked rows, sum of keyed_keys.waiting, reconcile's drift messages without repairing)."""
    from celery_keyed.ledger import check_counters_once

    with engine.connect() as conn:
        parked = int(conn.execute(sa.text("SELECT count(*) FROM keyed_waiting")).scalar_one())
        counted = int(conn.execute(sa.text("SELECT COALESCE(sum(waiting), 0) FROM keyed_keys")).scalar_one())
    return parked, counted, check_counters_once(engine, repair=False)
