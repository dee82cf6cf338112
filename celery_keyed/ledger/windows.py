"""Rate windows per key (``keyed_names.windows``): at most N starts of a key in any window of T seconds, for every
window of its name, beside or instead of its token bucket.

The take itself is one call of ``keyed_take_rate`` (``keys.keys_take_tokens``), under the key's head row lock, with
the bucket: all or none. Each key keeps the times of its latest starts in a ring (``keyed_window_starts``, one row per
start up to its name's largest N, overwritten in place) and a head row (``keyed_windows``: the next position, the
ring's size, the latest start's time). A start of cost c fits a window [N, T] when the start c - 1 positions before
the N-th latest is at least T old; starts are recorded in order, so that one decides. An attempt refused by a window
parks with the time its oldest start in the way leaves it (its not-before time: the sweep promotes it then, D2).

Here: what operators read (``usage``: per window, the starts in it now and when the next one frees) and what
reconcile deletes (``prune``: a key's rows once its latest start is older than its name's longest window, or its
name has no windows any more). The head rows are apart from ``keyed_keys``, which reconcile drops for an idle key:
a daily quota outlives that.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW

# windows_usage: per window of a key's name (shortest first): its N and length, the key's starts inside it now, and
# when the latest of them that keeps the window full leaves it (NULL while the window has room).
WINDOWS_USAGE = sa.text(
    f"""
    SELECT w.n, w.seconds,
           (SELECT count(*) FROM keyed_window_starts s
             WHERE s.key = :key AND s.at > {NOW} - make_interval(secs => w.seconds)) AS used,
           (SELECT s.at + make_interval(secs => w.seconds)
              FROM keyed_windows h JOIN keyed_window_starts s ON s.key = h.key AND s.pos = h.next_pos - w.n
             WHERE h.key = :key AND s.at + make_interval(secs => w.seconds) > {NOW}) AS frees_at
      FROM keyed_names c,
           LATERAL (SELECT CAST(e ->> 0 AS integer) AS n, CAST(e ->> 1 AS double precision) AS seconds
                      FROM jsonb_array_elements(c.windows) AS e) w
     WHERE c.name = :name
     ORDER BY w.seconds
    """
)

# windows_prune: the head rows (and, by cascade, the starts) of keys whose latest start is older than their name's
# longest window, or whose name has no windows any more. A take racing it holds the head row locked and moves
# last_at: the DELETE re-checks its condition on the row's newest version and leaves it.
WINDOWS_PRUNE = sa.text(
    f"""
    WITH gone AS (
        DELETE FROM keyed_windows h
         WHERE h.key IN (SELECT h2.key FROM keyed_windows h2 LEFT JOIN keyed_names c ON c.name = h2.name
                          WHERE c.windows IS NULL
                             OR h2.last_at + make_interval(secs => (
                                    SELECT max(CAST(e ->> 1 AS double precision))
                                      FROM jsonb_array_elements(c.windows) AS e)) <= {NOW}
                          ORDER BY h2.key LIMIT :batch)
           AND (NOT EXISTS (SELECT 1 FROM keyed_names c WHERE c.name = h.name AND c.windows IS NOT NULL)
                OR h.last_at + make_interval(secs => (
                       SELECT max(CAST(e ->> 1 AS double precision))
                         FROM keyed_names c, jsonb_array_elements(c.windows) AS e WHERE c.name = h.name)) <= {NOW})
        RETURNING 1
    )
    SELECT count(*) FROM gone
    """
)

PRUNE_BATCH = 1000


@dataclass(frozen=True)
class WindowUse:
    """One window of a key: at most ``n`` starts in any ``seconds``; ``used`` starts inside it now; ``frees_at``:
    while it is full, when its next start may come (None: it has room)."""

    n: int
    seconds: float
    used: int
    frees_at: datetime | None

    @property
    def full(self) -> bool:
        return self.frees_at is not None


def usage(conn: sa.Connection, key: str, name: str, *, now: datetime | None = None) -> list[WindowUse]:
    """The windows of ``key`` (of name ``name``) as they stand now; empty when its name has none."""
    rows = conn.execute(WINDOWS_USAGE, {"key": key, "name": name, "now": now})
    return [WindowUse(int(r.n), float(r.seconds), int(r.used), r.frees_at) for r in rows]


def prune(engine: sa.Engine, *, now: datetime | None = None, batch: int = PRUNE_BATCH) -> int:
    """Delete the window rows no window can read any more (reconcile), in transactions of ``batch`` keys."""
    pruned = 0
    while True:
        with engine.begin() as conn:
            n = int(conn.execute(WINDOWS_PRUNE, {"now": now, "batch": batch}).scalar_one())
        pruned += n
        if n < batch:
            return pruned


#: A window's length in the largest unit that counts it whole: (unit as settings write it, in words, seconds).
_UNITS = (("d", "day", 86400.0), ("h", "hour", 3600.0), ("m", "minute", 60.0), ("s", "second", 1.0))


def _whole(seconds: float) -> tuple[int, str, str] | None:
    """``seconds`` as a whole count of the largest unit that counts it whole: (count, "m", "minute"), else None."""
    for short, word, per in _UNITS:
        count = seconds / per
        if count >= 1 and abs(count - round(count)) < 1e-9:
            return round(count), short, word
    return None


def window_text(n: int, seconds: float) -> str:
    """A window as people write it: "100/m", "10000/d", "5/10s"."""
    whole = _whole(seconds)
    if whole is None:
        return f"{n}/{seconds:g}s"
    count, short, _ = whole
    return f"{n}/{short}" if count == 1 else f"{n}/{count}{short}"


def window_length_text(seconds: float) -> str:
    """A window's length in words: "minute", "10 seconds", "day"."""
    whole = _whole(seconds)
    if whole is None:
        return f"{seconds:g} seconds"
    count, _, word = whole
    return word if count == 1 else f"{count} {word}s"


def rate_text(rate: float) -> str:
    """Starts per second in the unit that shows it as a whole number, as it was most likely configured ("100/m")."""
    return next(
        (
            f"{round(rate * per):g}/{unit}"
            for unit, per in (("s", 1), ("m", 60), ("h", 3600))
            if abs(rate * per - round(rate * per)) < 1e-6 and round(rate * per) >= 1
        ),
        f"{rate:g}/s",
    )
