"""Books lost with a failover of the ledger, settled from the result backend (D20; part of the reconcile beat task).

After a standby is promoted, a keyed task that arrived, ran and finished on the old primary in the replication lag
it lost has no row in the books when its worker died too (a worker that survives settles its own). What survives is
its result. Once the failover's hold is over, each reconciler process reads, once per failover, the results stored
from ``FAILOVER_LOOKBACK`` seconds before the failover to the hold's end; a SUCCESS or FAILURE of a keyed task the
books never saw is booked completed or failed — or, for a ``Keyed…`` failure the ledger stored for a task that never
ran, that outcome (rejected, expired, …) — by ``ledger.LostBooks.settle``: guarded in PostgreSQL, one outcome per
task whoever else settles it.

What it needs from the result backend: a Redis result backend (its keys are listed with SCAN) and extended results
(``result_extended = True``: the task's name and arguments tell whether it was keyed, and its key). A task with no
final result (a body that never ended, ``ignore_result``) is left to its redelivery, which runs it and books it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from celery_keyed.call_keys import evaluate_keys, key_spec
from celery_keyed.exceptions import BY_OUTCOME
from celery_keyed.ledger import Ledger, LostArrival, LostBooks

logger = logging.getLogger("celery_keyed")

#: Seconds before a failover's detection whose results are read: the replication lag a failover may lose, and then
#: some (results older than this are not looked at; neither are any older than the books' retention).
FAILOVER_LOOKBACK = 600.0

#: Result keys read per round trip.
SCAN_BATCH = 500

_OUTCOMES = {"SUCCESS": "completed", "FAILURE": "failed"}

#: The never-ran outcome of each ``Keyed…`` failure the ledger stores for a task that did not run (rejected, …).
_NEVER_RAN = {cls.__name__: outcome for outcome, cls in BY_OUTCOME.items()}

#: The failovers (their detection time) this process has settled the lost books of.
_settled: set[datetime] = set()


def settle_lost_arrivals(app: Any, ledger: Ledger, *, retention: float | None = None) -> int:
    """Once per failover, after its hold: book the tasks the ledger lost with it from their stored results (see the
    module). How many were booked."""
    books = LostBooks(ledger.engine)
    failover = books.last_failover()
    if failover is None or failover.holding or failover.at in _settled:
        return 0
    since = failover.at - timedelta(seconds=FAILOVER_LOOKBACK)
    if retention is not None:
        since = max(since, failover.now - timedelta(seconds=retention))
    scan = _result_scanner(app)
    if scan is None:
        logger.warning(
            "celery-keyed reconcile: after the ledger's failover at %s, tasks lost with the old primary cannot be "
            "settled from their results: the result backend is not Redis (or there is none)", failover.at)
        _settled.add(failover.at)
        return 0
    settled = 0
    unextended = 0
    try:
        for metas in scan:
            candidates: dict[str, LostArrival] = {}
            for meta in metas:
                lost = _lost_arrival(app, meta, since=since, until=failover.hold_until)
                if lost is _UNEXTENDED:
                    unextended += 1
                elif isinstance(lost, LostArrival):
                    candidates[lost.task_id] = lost
            for task_id in sorted(books.never_seen(list(candidates))):
                lost = candidates[task_id]
                if books.settle(lost):
                    settled += 1
                    logger.warning(
                        "celery-keyed reconcile: %s (%s) was lost with the ledger's failover; booked %s from its "
                        "result", task_id, lost.task_name, lost.outcome)
    except Exception:  # the result backend or the ledger unreachable: the next run reads them all again
        logger.warning("celery-keyed reconcile: settling the books lost with the ledger's failover stopped; the "
                       "next run tries again", exc_info=True)
        return settled
    if unextended:
        logger.warning(
            "celery-keyed reconcile: %d results stored around the ledger's failover carry no task name "
            "(result_extended is off): tasks among them lost with the old primary stay out of the books", unextended)
    _settled.add(failover.at)
    return settled


_UNEXTENDED = object()


def _lost_arrival(app: Any, meta: Any, *, since: datetime, until: datetime) -> object:
    """The outcome a stored result gives a keyed task, when it is a final result stored in [since, until]; None
    for anything else; ``_UNEXTENDED`` for a final result in the window that has no task name."""
    if not isinstance(meta, dict):
        return None
    outcome = _OUTCOMES.get(str(meta.get("status")))
    done = _parse_date(meta.get("date_done"))
    task_id = meta.get("task_id")
    if outcome is None or done is None or not isinstance(task_id, str) or not since <= done <= until:
        return None
    name = meta.get("name")
    if not isinstance(name, str):
        return _UNEXTENDED
    task = app.tasks.get(name)
    if task is None or key_spec(task, "group_key") is not None:
        return None  # not a task of this app, or a group member (its group settles it: a registered number's timeout)
    spec = key_spec(task, "concurrency_key")
    if spec is None:
        return None
    try:
        keys = evaluate_keys(spec, task, tuple(meta.get("args") or ()), dict(meta.get("kwargs") or {}))
    except Exception:  # arguments the key cannot be computed from: the worker rejected such a call, it has books
        return None
    if keys is None:
        return None  # a call of a keyed task without a key: never in the books
    key = keys if isinstance(keys, str) else keys[0]
    if outcome == "failed":
        outcome = _NEVER_RAN.get(_exception_name(meta.get("result")), outcome)
    retries = meta.get("retries")
    attempt = retries if isinstance(retries, int) and retries >= 0 else 0
    return LostArrival(task_id=task_id, attempt=attempt, task_name=name, key=key, outcome=outcome)


def _exception_name(result: Any) -> str:
    """The class name of a stored failure: a dict of a JSON result (``exc_type``) or the exception (pickle)."""
    if isinstance(result, dict):
        return str(result.get("exc_type") or "")
    return type(result).__name__ if isinstance(result, BaseException) else ""


def _parse_date(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        done = value
    elif isinstance(value, str):
        try:
            done = datetime.fromisoformat(value)
        except ValueError:
            return None
    else:
        return None
    return done if done.tzinfo is not None else done.replace(tzinfo=UTC)


def _result_scanner(app: Any) -> Iterator[list[Any]] | None:
    """The stored task results of a Redis result backend, in batches (None: another backend)."""
    backend = app.backend
    client = getattr(backend, "client", None)
    prefix = getattr(backend, "task_keyprefix", None)
    if client is None or not hasattr(client, "scan_iter") or not isinstance(prefix, bytes | str):
        return None

    def batches() -> Iterator[list[Any]]:
        keys: list[Any] = []
        pattern = prefix + b"*" if isinstance(prefix, bytes) else f"{prefix}*"
        for key in client.scan_iter(match=pattern, count=SCAN_BATCH):
            keys.append(key)
            if len(keys) >= SCAN_BATCH:
                yield _decode(backend, client.mget(keys))
                keys = []
        if keys:
            yield _decode(backend, client.mget(keys))

    return batches()


def _decode(backend: Any, values: list[Any]) -> list[Any]:
    metas = []
    for value in values:
        if value is None:
            continue
        try:
            metas.append(backend.decode_result(value))
        except Exception:  # a value this app cannot decode (another serializer): not ours to judge
            continue
    return metas
