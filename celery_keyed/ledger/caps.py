"""Caps: a bound on all the keys of a name together (``NameConfig.cap``), and borrowing (``NameConfig.borrow``).

A name's cap is a key of its own, ``"<name>#cap"`` (no user key can be spelled so: a name has no ``#``), whose
name row holds the cap as its limit (``names.names_upsert`` writes both rows). Every task of a key of a capped name
also takes a slot of the cap key: the ledger adds it to the arrival's keys (``Caps.apply``, at every entry of
admission), so the cap is one more key of a multi-key claim — all or none, the same line, reservation, release,
reclaim and counter checks as any key. Borrowing is in the key's limit (``keyed_key_limit``): while no task waits in
the cap key's line, a key of a borrowing name may hold up to the cap instead of its own limit.

Which names have a cap is read from the ledger, at most every ``CAPS_TTL`` seconds per process (and at once after
this process configures names): a cap configured by another worker applies here within that time. A task that
arrived before its name had a cap does not count against it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import sqlalchemy as sa

from celery_keyed.ledger.attempts import Arrival
from celery_keyed.ledger.keyspec import key_name
from celery_keyed.ledger.migrations import schema_required

#: What a name's cap key adds to the name (``"tenant#cap"``).
CAP_SUFFIX = "#cap"
#: Seconds a process keeps the set of capped names before it reads it again.
CAPS_TTL = 5.0

# caps_names: the names with a cap.
CAPS_NAMES = sa.text("SELECT name FROM keyed_names WHERE cap IS NOT NULL")


def cap_key(name: str) -> str:
    """The key (and name) that counts the slots all the keys of ``name`` hold together."""
    return name + CAP_SUFFIX


def capped_name(key: str) -> str | None:
    """The name whose cap ``key`` is, or None for any other key."""
    return key[: -len(CAP_SUFFIX)] if key.endswith(CAP_SUFFIX) and ":" not in key else None


class Caps:
    """The capped names of a ledger, cached for ``ttl`` seconds; ``apply`` gives an arrival its cap keys."""

    def __init__(self, engine: sa.Engine, *, ttl: float = CAPS_TTL) -> None:
        self._engine = engine
        self._ttl = ttl
        self._names: frozenset[str] = frozenset()
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def names(self) -> frozenset[str]:
        """The capped names, read again when older than the ttl."""
        if self._stale():
            with self._lock:
                if self._stale():  # another thread may have read them meanwhile
                    self._read()
        return self._names

    def refresh(self) -> None:
        """Read the capped names now."""
        with self._lock:
            self._read()

    def _stale(self) -> bool:
        read_at = self._read_at
        return read_at is None or time.monotonic() - read_at > self._ttl

    def _read(self) -> None:
        with schema_required(self._engine), self._engine.connect() as conn:
            names = frozenset(conn.execute(CAPS_NAMES).scalars())
        self._names, self._read_at = names, time.monotonic()

    def apply(self, arrival: Arrival) -> Arrival:
        """``arrival`` with the cap key of each capped name among its keys' names added after its keys (unchanged
        when none is capped)."""
        if arrival.key is None:
            return arrival
        capped = self.names()
        if not capped:
            return arrival
        wanted = [cap_key(n) for n in dict.fromkeys(key_name(k) for k in arrival.keys) if n in capped]
        missing = tuple(k for k in wanted if k not in arrival.keys)
        if not missing:
            return arrival
        return dataclasses.replace(arrival, extra_keys=(*arrival.extra_keys, *missing))
