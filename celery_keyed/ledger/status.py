"""Status: read-only views of the ledger for operators (``celery keyed status``, the Prometheus collector).

Each view is one aggregated statement (no query per name or key), bounded by a statement timeout of the
caller's choosing, so it stays cheap on 100,000 keys. The counters are the ones admission keeps under the
key rows' locks (D1): in flight = ``keyed_slots.used`` summed over a key's shards (every slot held: running,
promoted and uncertain claims, and the reservations of multi-key waiters), waiting = ``keyed_keys.waiting``
(attempts in the key's line). A key may have slot rows and no head row yet (the fast admission path
creates only what it needs), hence the full joins. A name's effective limit and its ``source`` are read from
``keyed_limits`` (migration 0020: ``keyed_effective_limit``'s rule, a live override, else the configured limit, with
the one set of labels ``override`` / ``config``), the function the Django admin reads too (``name_limit_sql``); a
name it does not list (only seen through its keys) runs at 1, source ``default``. A key's limit is
``keyed_key_limit``'s: its own pause (source ``key_paused``) or its own limit (``key``) when it has
one and its name is not paused, else its name's override, else the limit its latest call computed (``call``), else
its name's configured limit. Nothing here writes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.slots import in_flight

#: A name's limit and source when ``keyed_limits`` does not list it (neither configured nor overridden): a mutex.
_DEFAULTS = {"slot_limit": "1", "source": "'default'"}


def name_limit_sql(column: Literal["slot_limit", "source"], name: str, now: str = "now()") -> str:
    """SQL for a name's effective ``slot_limit`` or its ``source`` (``column``) at ``now``, from ``keyed_limits``
    (migration 0020), with the default of a name it does not list, as the status views read them; ``name`` is SQL
    for the name (a column). The Django admin reads a name's limit and source through it (a correlated subquery per
    shown row; the function is inlined, so it costs lookups by primary key)."""
    return (f"COALESCE((SELECT l.{column} FROM keyed_limits({now}) l WHERE l.name = {name}), "
            f"{_DEFAULTS[column]})")


def limited_names_sql(*, source: Literal["override", "config"] | None = None, paused: bool = False,
                      now: str = "now()") -> str:
    """SQL listing the names ``keyed_limits`` lists at ``now`` (every name whose source is not the default), only
    those of ``source``, or only the paused ones (effective limit 0): for a semi-join (``name IN (...)``) over the
    small tables of configured and overridden names, as the Django admin's filters use it."""
    where = []
    if source is not None:
        if source not in ("override", "config"):
            raise ValueError(f"keyed_limits gives no source {source!r}")
        where.append(f"source = '{source}'")
    if paused:
        where.append("slot_limit = 0")
    return f"SELECT name FROM keyed_limits({now})" + (f" WHERE {' AND '.join(where)}" if where else "")


#: The effective limit, its source and the live override of a name, from ``keyed_limits`` joined as ``l``.
_LIMIT_COLUMNS = f"""
           COALESCE(l.slot_limit, {_DEFAULTS["slot_limit"]}) AS slot_limit,
           COALESCE(l.source, {_DEFAULTS["source"]}) AS source,
           l.configured_limit, l.override_reason, l.override_author, l.override_expires_at"""

#: Seconds since the oldest waiting arrival ``w.oldest`` (NULL when nothing waits).
_AGE = f"CASE WHEN w.oldest IS NOT NULL THEN GREATEST(EXTRACT(EPOCH FROM {NOW} - w.oldest), 0) END"

# status_names: one row per name the ledger knows (configured, overridden, or with keys): its effective limit
# and where it comes from, its keys, and the sums of in flight and waiting, with the oldest waiting arrival.
STATUS_NAMES = sa.text(
    f"""
    WITH slot AS (
        SELECT key, min(name) AS name, sum({in_flight('used')}) AS in_flight FROM keyed_slots
         WHERE CAST(:name AS text) IS NULL OR name = :name GROUP BY key
    ), head AS (
        SELECT key, name, waiting FROM keyed_keys WHERE CAST(:name AS text) IS NULL OR name = :name
    ), per_key AS (
        SELECT COALESCE(s.name, h.name) AS name, COALESCE(s.in_flight, 0) AS in_flight,
               COALESCE(h.waiting, 0) AS waiting
          FROM slot s FULL JOIN head h ON h.key = s.key
    ), per_name AS (
        SELECT name, count(*) AS keys, sum(in_flight) AS in_flight, sum(waiting) AS waiting,
               count(*) FILTER (WHERE in_flight > 0 OR waiting > 0) AS busy_keys
          FROM per_key GROUP BY name
    ), oldest AS (
        SELECT split_part(key, ':', 1) AS name, min(arrived_at) AS oldest,
               count(*) FILTER (WHERE debounce_cap IS NOT NULL AND not_before > {NOW}) AS debounced
          FROM keyed_waiting
         WHERE key IS NOT NULL AND NOT shadow
           AND (CAST(:name AS text) IS NULL OR split_part(key, ':', 1) = :name)
         GROUP BY 1
    ), own AS (
        SELECT name, count(*) FILTER (WHERE paused_until > {NOW}) AS paused_keys,
               count(*) FILTER (WHERE slot_limit IS NOT NULL AND (expires_at IS NULL OR expires_at > {NOW}))
                   AS limited_keys
          FROM keyed_key_overrides WHERE CAST(:name AS text) IS NULL OR name = :name GROUP BY name
    ), called AS (
        SELECT name, count(*) AS call_limited_keys FROM keyed_call_limits
         WHERE CAST(:name AS text) IS NULL OR name = :name GROUP BY name
    ), windowed AS (
        SELECT h.name,
               count(*) FILTER (WHERE EXISTS (
                   SELECT 1 FROM jsonb_array_elements(c.windows) AS e
                     JOIN keyed_window_starts s
                       ON s.key = h.key AND s.slot = (h.next_pos - CAST(e ->> 0 AS integer)) % h.ring
                      AND s.pos = h.next_pos - CAST(e ->> 0 AS integer)
                    WHERE s.at + make_interval(secs => CAST(e ->> 1 AS double precision)) > {NOW})) AS window_full_keys
          FROM keyed_windows h JOIN keyed_names c ON c.name = h.name
         WHERE CAST(:name AS text) IS NULL OR h.name = :name GROUP BY h.name
    ), limits AS (
        SELECT * FROM keyed_limits({NOW})
    ), names AS (
        SELECT name FROM limits UNION SELECT name FROM per_name
        UNION SELECT name FROM own WHERE paused_keys > 0 OR limited_keys > 0
    )
    SELECT n.name, {_LIMIT_COLUMNS},
           COALESCE(p.keys, 0) AS keys, COALESCE(p.busy_keys, 0) AS busy_keys,
           COALESCE(p.in_flight, 0) AS in_flight, COALESCE(p.waiting, 0) AS waiting,
           w.oldest AS oldest_waiting_at,
           {_AGE} AS oldest_waiting_age,
           c.rate, c.burst, c.windows, c.cap, COALESCE(c.borrow, false) AS borrow, COALESCE(c.fair, false) AS fair,
           c.uncertain_hold, c.config_version,
           COALESCE(c.shards, 1) AS shards, c.max_waiting, c.max_wait, COALESCE(c.overflow, 'reject') AS overflow,
           COALESCE(c.group_failure, 'halt') AS group_failure,
           COALESCE(w.debounced, 0) AS debounced,
           COALESCE(k.paused_keys, 0) AS paused_keys, COALESCE(k.limited_keys, 0) AS limited_keys,
           COALESCE(cl.call_limited_keys, 0) AS call_limited_keys,
           COALESCE(wf.window_full_keys, 0) AS window_full_keys
      FROM names n
      LEFT JOIN limits l ON l.name = n.name
      LEFT JOIN keyed_names c ON c.name = n.name
      LEFT JOIN per_name p ON p.name = n.name
      LEFT JOIN oldest w ON w.name = n.name
      LEFT JOIN own k ON k.name = n.name
      LEFT JOIN called cl ON cl.name = n.name
      LEFT JOIN windowed wf ON wf.name = n.name
     WHERE CAST(:name AS text) IS NULL OR n.name = :name
     ORDER BY n.name
    """
)

# status_keys: the busiest keys (most waiting, then most in flight), at most :limit rows, with their limit and
# oldest waiting arrival (looked up by index for the rows returned only). :idle also lists keys with nothing
# held or parked.
STATUS_KEYS = sa.text(
    f"""
    WITH slot AS (
        SELECT key, min(name) AS name, sum({in_flight('used')}) AS in_flight FROM keyed_slots
         WHERE CAST(:name AS text) IS NULL OR name = :name GROUP BY key
    ), head AS (
        SELECT key, name, waiting FROM keyed_keys WHERE CAST(:name AS text) IS NULL OR name = :name
    ), per_key AS (
        SELECT COALESCE(s.key, h.key) AS key, COALESCE(s.name, h.name) AS name,
               COALESCE(s.in_flight, 0) AS in_flight, COALESCE(h.waiting, 0) AS waiting
          FROM slot s FULL JOIN head h ON h.key = s.key
    ), top AS (
        SELECT * FROM per_key WHERE :idle OR in_flight > 0 OR waiting > 0
         ORDER BY waiting DESC, in_flight DESC, key LIMIT :limit
    )
    SELECT t.key, t.name, {_LIMIT_COLUMNS},
           t.in_flight, t.waiting, w.oldest AS oldest_waiting_at,
           {_AGE} AS oldest_waiting_age,
           keyed_key_limit(t.key, {NOW}) AS key_limit,
           CASE WHEN ko.paused_until > {NOW} THEN ko.paused_until END AS paused_until,
           CASE WHEN ko.expires_at IS NULL OR ko.expires_at > {NOW} THEN ko.slot_limit END AS own_limit,
           cl.slot_limit AS call_limit
      FROM top t
      LEFT JOIN keyed_limits({NOW}) l ON l.name = t.name
      LEFT JOIN keyed_key_overrides ko ON ko.key = t.key
      LEFT JOIN keyed_call_limits cl ON cl.key = t.key
      LEFT JOIN LATERAL (
          SELECT min(x.arrived_at) AS oldest FROM keyed_waiting x WHERE x.key = t.key AND NOT x.shadow
      ) w ON t.waiting > 0
     ORDER BY t.waiting DESC, t.in_flight DESC, t.key
    """
)

# status_key_count: keys the ledger holds rows for (status prints "N more" below a truncated table).
STATUS_KEY_COUNT = sa.text(
    """
    SELECT count(*) FROM (SELECT key FROM keyed_slots WHERE CAST(:name AS text) IS NULL OR name = :name
                          UNION SELECT key FROM keyed_keys WHERE CAST(:name AS text) IS NULL OR name = :name) k
    """
)

# status_prepare: bound every statement of the caller's transaction (set_config(..., true) = SET LOCAL), and turn
# JIT compilation off for it: these aggregates are estimated far above their real size, and on 100,000 keys
# compiling them took 0.7 s of a 0.8 s query (the work itself: 0.1 s).
STATUS_PREPARE = sa.text("SELECT set_config('statement_timeout', :ms, true), set_config('jit', 'off', true)")

# status_now: the database's clock, the "at" of a status report (the ledger's one clock, D2).
STATUS_NOW = sa.text("SELECT now()")


@dataclass(frozen=True)
class NameStatus:
    """One name: its effective ``limit`` and ``source`` (``override``, ``config`` or ``default``), the live
    override's reason, author and expiry if any, its keys, and totals over them."""

    name: str
    limit: int
    source: str
    configured_limit: int | None
    override_reason: str | None
    override_author: str | None
    override_expires_at: datetime | None
    keys: int
    busy_keys: int
    in_flight: int
    waiting: int
    oldest_waiting_at: datetime | None
    oldest_waiting_age: float | None
    rate: float | None = None  # starts per second per key (token bucket), if configured
    burst: float | None = None
    windows: tuple[tuple[int, float], ...] | None = None  # rate windows per key: (N starts, in T seconds), if any
    cap: int | None = None  # the most all the keys of the name hold together (its cap key "<name>#cap" counts them)
    borrow: bool = False  # a key may hold up to the cap while no task waits for it
    fair: bool = False  # slots shared round-robin by fair key
    uncertain_hold: float | None = None
    config_version: int | None = None  # keyed_config_version that stored its configuration (None: not configured)
    debounced: int = 0  # of the waiting: debounced tasks still in their key's quiet period
    paused_keys: int = 0  # keys of the name paused on their own now (keyed_pause, pause-key)
    limited_keys: int = 0  # keys of the name with a limit of their own now (keyed_set_limit, set-key-limit)
    call_limited_keys: int = 0  # keys of the name whose latest call computed their limit (concurrency_limit)
    window_full_keys: int = 0  # keys of the name with a full rate window now (their next start waits for it)
    # the rules that refuse or end a task besides the limit: counter rows per key, the waiting room's size and what
    # a full one does (reject, or supersede the oldest), the longest wait before a task expires (None: no bound)
    shards: int = 1
    max_waiting: int | None = None
    overflow: str = "reject"
    max_wait: float | None = None
    group_failure: str = "halt"  # what a group of the name does when its head fails (halt, skip, hold)

    @property
    def paused(self) -> bool:
        return self.limit == 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "paused": self.paused}


@dataclass(frozen=True)
class KeyStatus:
    """One key: its effective ``limit`` and ``source`` (``key_paused`` / ``key``: the key's own pause or limit;
    ``call``: the limit its latest call computed; else its name's: ``override``, ``config`` or ``default``), in
    flight, waiting, oldest waiting arrival, and the end of its own pause (``paused_until``) if any."""

    key: str
    name: str
    limit: int
    source: str
    in_flight: int
    waiting: int
    oldest_waiting_at: datetime | None
    oldest_waiting_age: float | None
    paused_until: datetime | None = None

    @property
    def paused(self) -> bool:
        return self.limit == 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "paused": self.paused}


def status_prepare(conn: sa.Connection, *, timeout: float) -> None:
    """Prepare ``conn``'s current transaction for the views: statements bounded to ``timeout`` seconds (a scrape
    must not hang), no JIT. Call it inside a transaction (``engine.begin()``)."""
    conn.execute(STATUS_PREPARE, {"ms": str(max(1, int(timeout * 1000)))})


def status_now(conn: sa.Connection) -> datetime:
    """The database's time now (start of the caller's transaction): when the report was taken."""
    return conn.execute(STATUS_NOW).scalar_one()


def _age(value: Any) -> float | None:
    return None if value is None else float(value)


def status_names(conn: sa.Connection, *, name: str | None = None, now: datetime | None = None) -> list[NameStatus]:
    """Every name the ledger knows (or only ``name``), with its limit, source and totals."""
    rows = conn.execute(STATUS_NAMES, {"name": name, "now": now}).mappings()
    return [
        NameStatus(
            name=r["name"],
            limit=int(r["slot_limit"]),
            source=r["source"],
            configured_limit=r["configured_limit"],
            override_reason=r["override_reason"],
            override_author=r["override_author"],
            override_expires_at=r["override_expires_at"],
            keys=int(r["keys"]),
            busy_keys=int(r["busy_keys"]),
            in_flight=int(r["in_flight"]),
            waiting=int(r["waiting"]),
            oldest_waiting_at=r["oldest_waiting_at"],
            oldest_waiting_age=_age(r["oldest_waiting_age"]),
            rate=r["rate"],
            burst=r["burst"],
            windows=None if r["windows"] is None else tuple((int(n), float(t)) for n, t in r["windows"]),
            cap=r["cap"],
            borrow=bool(r["borrow"]),
            fair=bool(r["fair"]),
            uncertain_hold=r["uncertain_hold"],
            config_version=r["config_version"],
            debounced=int(r["debounced"]),
            paused_keys=int(r["paused_keys"]),
            limited_keys=int(r["limited_keys"]),
            call_limited_keys=int(r["call_limited_keys"]),
            window_full_keys=int(r["window_full_keys"]),
            shards=int(r["shards"]),
            max_waiting=r["max_waiting"],
            overflow=r["overflow"],
            max_wait=r["max_wait"],
            group_failure=r["group_failure"],
        )
        for r in rows
    ]


def status_keys(
    conn: sa.Connection,
    *,
    name: str | None = None,
    limit: int = 20,
    idle: bool = False,
    now: datetime | None = None,
) -> list[KeyStatus]:
    """The ``limit`` busiest keys (or of ``name`` only): most waiting first, then most in flight. Keys with
    nothing held or parked are left out unless ``idle``."""
    rows = conn.execute(STATUS_KEYS, {"name": name, "limit": limit, "idle": idle, "now": now}).mappings()
    return [
        KeyStatus(
            key=r["key"],
            name=r["name"],
            limit=int(r["key_limit"]),
            source=_key_source(r),
            in_flight=int(r["in_flight"]),
            waiting=int(r["waiting"]),
            oldest_waiting_at=r["oldest_waiting_at"],
            oldest_waiting_age=_age(r["oldest_waiting_age"]),
            paused_until=r["paused_until"],
        )
        for r in rows
    ]


def _key_source(row: Any) -> str:
    """Where a key's limit comes from (as ``keyed_key_limit`` decides): a paused name pauses every key; else the
    key's own pause, else its own limit, else its name's override, else the limit its latest call computed
    (``call``), else its name's source."""
    if int(row["slot_limit"]) == 0:
        return str(row["source"])
    if row["paused_until"] is not None:
        return "key_paused"
    if row["own_limit"] is not None:
        return "key"
    if row["source"] != "override" and row["call_limit"] is not None:
        return "call"
    return str(row["source"])


def status_key_count(conn: sa.Connection, *, name: str | None = None) -> int:
    """How many keys the ledger holds rows for (of ``name`` only, when given)."""
    return int(conn.execute(STATUS_KEY_COUNT, {"name": name}).scalar_one())


# status_recent: per name, the arrivals turned away (rejected) and ended unrun (expired) in the last :seconds, and
# the drift reconcile found and repaired in that time (keyed_events). Reads the books through their outcome index
# (outcome, finished_at) and the events by time; tasks without a key (unreadable keys) are left out.
STATUS_RECENT = sa.text(
    f"""
    WITH outcomes AS (
        SELECT split_part(t.key, ':', 1) AS name,
               count(*) FILTER (WHERE t.outcome = 'rejected') AS rejected,
               count(*) FILTER (WHERE t.outcome = 'expired') AS expired
          FROM keyed_tasks t
         WHERE t.outcome IN ('rejected', 'expired') AND t.finished_at > {NOW} - make_interval(secs => :seconds)
           AND t.key IS NOT NULL
         GROUP BY 1
    ), drift AS (
        SELECT split_part(e.key, ':', 1) AS name, count(*) AS drift
          FROM keyed_events e
         WHERE e.kind = 'drift' AND e.at > {NOW} - make_interval(secs => :seconds) AND e.key IS NOT NULL
         GROUP BY 1
    )
    SELECT COALESCE(o.name, d.name) AS name, COALESCE(o.rejected, 0) AS rejected,
           COALESCE(o.expired, 0) AS expired, COALESCE(d.drift, 0) AS drift
      FROM outcomes o FULL JOIN drift d ON d.name = o.name
    """
)


@dataclass(frozen=True)
class RecentStatus:
    """What happened to a name's tasks lately (``status_recent``): arrivals rejected, tasks expired unrun, and
    counter drift that reconcile repaired."""

    rejected: int = 0
    expired: int = 0
    drift: int = 0


def status_recent(
    conn: sa.Connection, *, seconds: float = 3600.0, now: datetime | None = None
) -> dict[str, RecentStatus]:
    """Per name with any: its rejections, expiries and repaired drift in the last ``seconds``."""
    rows = conn.execute(STATUS_RECENT, {"seconds": seconds, "now": now}).mappings()
    return {
        r["name"]: RecentStatus(rejected=int(r["rejected"]), expired=int(r["expired"]), drift=int(r["drift"]))
        for r in rows
    }
