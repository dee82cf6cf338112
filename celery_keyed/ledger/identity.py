"""The ledger's identity (table ``keyed_ledger_identity``, D20): which server wrote it last, and failovers.

A server is known by its system identifier, its timeline and its postmaster's start. A standby promoted (a new
timeline) or another server may have lost the previous server's last commits, among them claims of bodies that still
run; a restart of the same server (a new start only) lost nothing (the ledger's transactions are durable) and is only
logged. The first contact with a new server (``identity_check``: each new connection of an engine
``watch_engine`` watches, each heartbeat, each reconcile) records the change, and from then on, for one lease, the
ledger inserts no claim but the re-assertion of a running attempt's own (``claims_reassert``); the guard is a trigger
on ``keyed_claims`` (migration 0025), never this module's Python.

Each process also remembers, per ledger (its engine's URL: a multi-host URL names one ledger through its failovers),
the identity it last saw (``remembered``), and logs a change once ("ledger failover: ...").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

logger = logging.getLogger("celery_keyed")

# keyed_ledger_identity_check: compare the server's identity with the ledger's; a change holds new starts for p_lease.
IDENTITY_CHECK = "SELECT kind, previous, current_identity, hold_until FROM keyed_ledger_identity_check(%s)"
IDENTITY_CHECK_SA = sa.text(
    "SELECT kind, previous, current_identity, hold_until FROM keyed_ledger_identity_check(:lease)"
)

# claims_holding_of: what the running claims of this holder hold (to take one back after a failover).
CLAIMS_HOLDING_OF = sa.text(
    """
    SELECT c.task_id, c.attempt, c.fence, c.key, c.shard, c.cost, s.name,
           (c.group_key IS NOT NULL OR c.extra_keys IS NOT NULL) AS composite
      FROM keyed_claims c LEFT JOIN keyed_slots s ON s.key = c.key AND s.shard = c.shard
     WHERE c.holder = :holder AND c.state = 'running'
       AND (c.task_id, c.attempt, c.fence) IN (
           SELECT * FROM unnest(CAST(:task_ids AS text[]), CAST(:attempts AS integer[]), CAST(:fences AS bigint[])))
    """
)

# claims_reassert: a running attempt takes its lost claim back under the slot guard (keyed_claims_reassert).
CLAIMS_REASSERT = sa.text(
    """
    SELECT keyed_claims_reassert(:task_id, :attempt, :fence, :holder, :key, :shard, :name, :cost, :task_name,
                                 :lease) AS verdict
    """
)


# tokens_unknown: of these attempt tokens, those the ledger has no trace of (no waiting row, no claim, no outcome of the
# attempt or a later one): a parked attempt whose row was lost with the previous server's last commits.
TOKENS_UNKNOWN = sa.text(
    """
    SELECT t.task_id, t.attempt
      FROM unnest(CAST(:task_ids AS text[]), CAST(:attempts AS integer[])) AS t(task_id, attempt)
     WHERE NOT EXISTS (SELECT 1 FROM keyed_waiting w WHERE w.task_id = t.task_id AND w.attempt = t.attempt)
       AND NOT EXISTS (SELECT 1 FROM keyed_claims c WHERE c.task_id = t.task_id AND c.attempt >= t.attempt)
       AND NOT EXISTS (SELECT 1 FROM keyed_tasks k WHERE k.task_id = t.task_id
                          AND (k.outcome IS NOT NULL OR k.finished_attempt >= t.attempt))
    """
)


# tasks_without_outcome: of these task ids, those the books have no outcome for (no row, or an open one), with the
# fence of the claim the ledger holds for the given attempt (None: none).
TASKS_WITHOUT_OUTCOME = sa.text(
    """
    SELECT t.task_id, t.attempt, c.fence
      FROM unnest(CAST(:task_ids AS text[]), CAST(:attempts AS integer[])) AS t(task_id, attempt)
      LEFT JOIN keyed_claims c ON c.task_id = t.task_id AND c.attempt = t.attempt
     WHERE NOT EXISTS (SELECT 1 FROM keyed_tasks k WHERE k.task_id = t.task_id AND k.outcome IS NOT NULL)
    """
)

# books_settle: record the final outcome of an attempt whose arrival and release were both lost (keyed_books_settle).
BOOKS_SETTLE = sa.text("SELECT keyed_books_settle(:task_id, :attempt, :task_name, :key, :outcome)")


@dataclass(frozen=True)
class IdentityCheck:
    """What ``identity_check`` found: ``kind`` of change this call detected (None: none), the identities before and
    now, and until when new starts wait (None: they do not)."""

    kind: str | None
    previous: str | None
    current: str | None
    hold_until: datetime | None


@dataclass(frozen=True)
class ClaimHolding:
    """What a running claim holds, as the ledger had it: enough to take it back (``claims_reassert``)."""

    task_id: str
    attempt: int
    fence: int
    key: str | None
    shard: int | None
    cost: int
    name: str | None
    composite: bool  # a group or several keys: not re-asserted (the body is stopped and runs again)


class ProcessIdentity:
    """The identity of the ledger's server as this process last saw it; ``changes`` counts the changes seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: str | None = None
        self.changes = 0
        self._logged: str | None = None  # the identity whose change was logged last

    def observe(self, check: IdentityCheck) -> bool:
        """Remember what ``check`` saw; True (and logged) when it is a change this process had not seen yet."""
        if check.current is None:
            return False
        with self._lock:
            before, self.current = self.current, check.current
            if check.kind == "restarted" or (before is not None and _lineage(before) == _lineage(check.current)):
                if before is not None and before != check.current:
                    logger.warning("celery-keyed: the ledger's server restarted (%s -> %s)", before, check.current)
                return False  # the same server's commits are durable: nothing was lost, nothing is held
            changed = check.kind is not None or (before is not None and before != check.current)
            if not changed or check.current == self._logged:
                return False
            self._logged = check.current
            self.changes += 1
        what = {"promoted": "a standby was promoted", "replaced": "another server", "restarted": "the server restarted"}
        logger.error(
            "celery-keyed: ledger failover: %s (%s -> %s); no new keyed start until %s, while running tasks "
            "re-assert their claims",
            what.get(check.kind or "", "a standby was promoted or the server restarted"),
            check.previous or before,
            check.current,
            check.hold_until,
        )
        return True


def _lineage(identity: str) -> str:
    """The system and timeline of an identity (``keyed_ledger_identity_check``'s text): a restart keeps them."""
    return identity.split(", started", 1)[0]


_MEMORIES: dict[str, ProcessIdentity] = {}
_MEMORIES_LOCK = threading.Lock()


def remembered(engine: sa.Engine) -> ProcessIdentity:
    """This process's memory of the identity of the ledger ``engine`` reaches (one per URL: the engines of a process
    that name the same servers share it)."""
    url = engine.url.render_as_string(hide_password=True)
    with _MEMORIES_LOCK:
        memory = _MEMORIES.get(url)
        if memory is None:
            memory = _MEMORIES[url] = ProcessIdentity()
        return memory


def _check_row(row: Any) -> IdentityCheck:
    if row is None:
        return IdentityCheck(None, None, None, None)
    return IdentityCheck(row[0], row[1], row[2], row[3])


def identity_check(conn: sa.Connection, *, lease: float) -> IdentityCheck:
    """Compare the server's identity with the ledger's (in the caller's transaction; commit it: a change detected is
    written), and remember it (``remembered``)."""
    check = _check_row(conn.execute(IDENTITY_CHECK_SA, {"lease": lease}).first())
    remembered(conn.engine).observe(check)
    return check


#: The engines ``watch_engine`` watches, with the lease their identity checks hold new starts for.
_WATCHED: weakref.WeakKeyDictionary[sa.Engine, dict[str, float]] = weakref.WeakKeyDictionary()


def watch_engine(engine: sa.Engine, *, lease: float) -> None:
    """Check the identity on every new connection of ``engine`` (its first contact with a server, so the first contact
    after a failover records it before the connection is used). A database without the ledger's schema is left
    alone. Idempotent per engine (the longest lease asked for is used)."""
    leases = _WATCHED.get(engine)
    if leases is not None:
        leases["lease"] = max(leases["lease"], lease)
        return
    leases = {"lease": lease}
    _WATCHED[engine] = leases

    def on_connect(dbapi_connection: Any, _record: Any) -> None:
        autocommit = dbapi_connection.autocommit
        try:
            dbapi_connection.autocommit = True  # one statement, its own transaction: no BEGIN / COMMIT round trips
            with dbapi_connection.cursor() as cursor:
                cursor.execute(IDENTITY_CHECK, (leases["lease"],))
                row = cursor.fetchone()
        except Exception:  # no schema yet, an older one, a read-only server: nothing to check
            return
        finally:
            with contextlib.suppress(Exception):
                dbapi_connection.autocommit = autocommit
        remembered(engine).observe(_check_row(row))

    sa.event.listen(engine, "connect", on_connect)


def claims_holding_of(conn: sa.Connection, holder: str, held: list[tuple[str, int, int]]) -> list[ClaimHolding]:
    """What the running claims ``held`` (task id, attempt, fence) of ``holder`` hold."""
    if not held:
        return []
    params = {
        "holder": holder,
        "task_ids": [h[0] for h in held],
        "attempts": [h[1] for h in held],
        "fences": [h[2] for h in held],
    }
    return [
        ClaimHolding(r.task_id, int(r.attempt), int(r.fence), r.key, r.shard, int(r.cost), r.name, bool(r.composite))
        for r in conn.execute(CLAIMS_HOLDING_OF, params)
    ]


def claims_reassert(conn: sa.Connection, holding: ClaimHolding, *, holder: str, task_name: str, lease: float) -> str:
    """Take a running attempt's lost claim back under the slot guard: 'kept', 'reasserted' or 'refused'."""
    if holding.composite or holding.key is None or holding.name is None:
        return "refused"
    params = {
        "task_id": holding.task_id,
        "attempt": holding.attempt,
        "fence": holding.fence,
        "holder": holder,
        "key": holding.key,
        "shard": holding.shard,
        "name": holding.name,
        "cost": holding.cost,
        "task_name": task_name,
        "lease": lease,
    }
    return str(conn.execute(CLAIMS_REASSERT, params).scalar_one())


def tokens_unknown(conn: sa.Connection, tokens: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Of ``tokens`` (task id, attempt), those the ledger has no trace of (see ``TOKENS_UNKNOWN``)."""
    if not tokens:
        return []
    params = {"task_ids": [t[0] for t in tokens], "attempts": [t[1] for t in tokens]}
    return [(r.task_id, int(r.attempt)) for r in conn.execute(TOKENS_UNKNOWN, params)]


def tasks_without_outcome(conn: sa.Connection, tokens: list[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
    """Of ``tokens`` (task id, attempt), those whose task has no outcome in the books, with the fence of the claim
    the ledger holds for that attempt (None: none)."""
    if not tokens:
        return {}
    params = {"task_ids": [t[0] for t in tokens], "attempts": [t[1] for t in tokens]}
    return {
        (r.task_id, int(r.attempt)): None if r.fence is None else int(r.fence)
        for r in conn.execute(TASKS_WITHOUT_OUTCOME, params)
    }


def books_settle(
    conn: sa.Connection, *, task_id: str, attempt: int, task_name: str, key: str | None, outcome: str
) -> bool:
    """Record a final outcome lost with the previous server (``keyed_books_settle``); True when recorded."""
    params = {"task_id": task_id, "attempt": attempt, "task_name": task_name, "key": key, "outcome": outcome}
    return bool(conn.execute(BOOKS_SETTLE, params).scalar())


class FailoverLedger:
    """The ledger's failover statements for one holder (a worker process), each in a transaction of its own: what a
    worker's failover watch calls (``worker.failover``)."""

    def __init__(self, engine: sa.Engine, holder: str) -> None:
        self.engine = engine
        self.holder = holder

    def changes(self) -> int:
        """How many changes of the ledger's server this process has seen (``remembered``)."""
        return remembered(self.engine).changes

    def check(self, *, lease: float, held: list[tuple[str, int, int]]) -> list[ClaimHolding]:
        """Check the server's identity (``identity_check``) and read what the running claims ``held`` (task id,
        attempt, fence) of this holder hold, in one transaction."""
        with self.engine.begin() as conn:
            identity_check(conn, lease=lease)
            return claims_holding_of(conn, self.holder, held)

    def reassert(self, holding: ClaimHolding, *, task_name: str, lease: float) -> str:
        """``claims_reassert`` for this holder: 'kept', 'reasserted' or 'refused'."""
        with self.engine.begin() as conn:
            return claims_reassert(conn, holding, holder=self.holder, task_name=task_name, lease=lease)

    def unknown(self, tokens: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """``tokens_unknown``."""
        with self.engine.connect() as conn:
            return tokens_unknown(conn, tokens)

    def without_outcome(self, tokens: list[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        """``tasks_without_outcome``."""
        with self.engine.connect() as conn:
            return tasks_without_outcome(conn, tokens)

    def settle(self, *, task_id: str, attempt: int, task_name: str, key: str | None, outcome: str) -> bool:
        """``books_settle``."""
        with self.engine.begin() as conn:
            return books_settle(conn, task_id=task_id, attempt=attempt, task_name=task_name, key=key, outcome=outcome)
