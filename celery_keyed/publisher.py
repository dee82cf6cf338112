"""The producer side's calls to the ledger (group registration at publish, D10; refusal at send;
the outbox), through the app's ledger access of this process (``access.publisher_for``:
one engine per process and app, created on first use; a forked pool child creates its own)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed import metrics
from celery_keyed.access import Publisher as Publisher  # re-exported: the app's ledger access lives in access.py
from celery_keyed.access import close_publisher as close_publisher
from celery_keyed.access import publisher_for
from celery_keyed.exceptions import KeyedRejected
from celery_keyed.headers import HEADER_GROUP, HEADER_KEY
from celery_keyed.ledger import Ledger, SendVerdict, outbox_register, sent_admit
from celery_keyed.messages import record_published, republish
from celery_keyed.settings import KeyedSettings

logger = logging.getLogger("celery_keyed")


class SendRefused(KeyedRejected):
    """A send refused by the ledger before anything was published (``keyed_admit_at_send``): ``reason`` is
    ``"room_full"`` (the key's waiting room, counting the sends not arrived yet, is at ``max_waiting``) or
    ``"duplicate"`` (``holder_task_id`` is the live task with the same dedupe key). Nothing was booked."""

    def __init__(self, task_id: str, key: str, verdict: SendVerdict) -> None:
        super().__init__(f"{task_id} refused at send under {key}: {verdict.detail}")
        self.task_id = task_id
        self.key = key
        self.reason = verdict.reason
        self.detail = verdict.detail
        self.holder_task_id = verdict.holder_task_id


def admit_at_send(
    app: Any, task_id: str, key: str, *, dedupe_key: str | None = None, connection: sa.Connection | None = None
) -> bool:
    """Ask the ledger, in one round trip, whether ``task_id`` may be published under ``key`` (its first
    concurrency key); raise :class:`SendRefused` (a ``KeyedRejected``) when not. ``connection``: decide in the
    caller's open transaction (the reservation commits or rolls back with it). True when this call reserved a new
    place (the caller gives it back with ``forget_send`` if the publish then fails); False for a task id that had
    one (a retry). An unreachable ledger raises its error: the caller asked for a check, nothing is published."""
    publisher = publisher_for(app, required=True)
    assert publisher is not None  # required=True raises instead
    timeout = publisher.settings.send_arrival_timeout
    if connection is not None:
        verdict = sent_admit(connection, task_id, key, dedupe_key=dedupe_key, arrival_timeout=timeout)
    else:
        verdict = publisher.ledger.admit_at_send(task_id, key, dedupe_key=dedupe_key, arrival_timeout=timeout)
    if not verdict.accepted:
        metrics.send_decided(verdict.reason)
        raise SendRefused(task_id, key, verdict)
    metrics.send_decided("known" if verdict.detail == "known" else "accepted")
    return verdict.detail != "known"


def forget_send(app: Any, task_id: str) -> None:
    """Give back the place reserved at send for ``task_id`` (its publish raised)."""
    publisher = publisher_for(app)
    if publisher is not None:
        publisher.ledger.forget_send(task_id)


def admits_at_send(app: Any, name: str) -> bool:
    """Whether the configuration of ``name`` asks producers to admit at send (``admit_at_send`` in
    ``keyed_concurrency_limits``); False when the app has no ledger configuration."""
    publisher = publisher_for(app)
    config = publisher.settings.limits.get(name) if publisher is not None else None
    return bool(config is not None and config.admit_at_send)


def registers_at_publish(app: Any, name: str | None) -> bool:
    """Whether this app's settings ask for the outbox for a task of ``name`` (``keyed_register_at_publish``, or
    ``register_at_publish`` of the name in ``keyed_concurrency_limits``); False without a ledger configuration."""
    publisher = publisher_for(app)
    if publisher is None:
        return False
    if publisher.settings.register_at_publish:
        return True
    config = publisher.settings.limits.get(name) if name is not None else None
    return bool(config is not None and config.register_at_publish)


class OutboxProducer:
    """The kombu producer Celery publishes one keyed task with when the outbox is on: its first
    ``publish`` (the task's message) stores the message in the ledger first — on ``connection``, the caller's open
    transaction, and then publishes nothing (the relay publishes it once that transaction has committed, so a
    rolled-back transaction publishes nothing and stores nothing); else in a transaction of its own, committed,
    and then publishes. Once stored, the message is the ledger's to deliver: a publish that raises after that is
    logged and left to the relay. Every other call (a ``task-sent`` event) goes to the real producer."""

    def __init__(
        self,
        producer: Any,
        app: Any,
        *,
        task_id: str,
        task_name: str,
        connection: Any = None,
        attempt: int = 0,
        keep_copy: bool = True,
    ) -> None:
        self._producer = producer
        self._app = app
        self._task_id = task_id
        self._task_name = task_name
        self._connection = connection
        self._attempt = attempt
        self._keep_copy = keep_copy
        self._done = False
        #: True once the message is stored in the outbox (False: the task id had arrived or was registered).
        self.stored = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, **kwargs: Any) -> Any:
        headers = kwargs.get("headers") or {}
        if self._done or headers.get("id") != self._task_id:
            return self._producer.publish(body, **kwargs)
        self._done = True
        record = record_published(
            body,
            task_name=self._task_name,
            exchange=kwargs.get("exchange"),
            routing_key=kwargs.get("routing_key"),
            headers=headers,
            serializer=kwargs.get("serializer"),
            compression=kwargs.get("compression"),
            content_type=kwargs.get("content_type"),
            content_encoding=kwargs.get("content_encoding"),
            properties=kwargs,
        )
        keys = headers.get(HEADER_KEY)
        first = keys[0] if isinstance(keys, list) and keys else keys
        publisher = publisher_for(self._app, required=True)
        assert publisher is not None  # required=True raises instead
        key = first if isinstance(first, str) else None
        group = headers.get(HEADER_GROUP) if isinstance(headers.get(HEADER_GROUP), str) else None
        if self._attempt > 0:
            return self._publish_retry(publisher, record, key, group, headers, body, kwargs)
        if self._connection is not None:
            self.stored = outbox_register(
                self._connection, self._task_id, record, task_name=self._task_name, key=key, group_key=group,
                pending=True,
            )
            if self.stored:
                return None  # the relay publishes it after the caller's commit
        else:
            self.stored = publisher.ledger.register_at_publish(
                self._task_id,
                record,
                task_name=self._task_name,
                key=key,
                group_key=group,
                eta=_eta(headers.get("eta")),
                arrival_timeout=arrival_timeout(publisher.settings, grouped=group is not None),
            )
        if not self.stored:  # arrived or registered already: a re-send, published as without the outbox
            return self._producer.publish(body, **kwargs)
        try:
            return self._producer.publish(body, **kwargs)
        except Exception as exc:
            logger.warning(
                "celery-keyed: publishing %s failed (%s); its message is stored in the outbox and will be published"
                " by the relay when it is due",
                self._task_id,
                exc,
            )
            return None

    def _publish_retry(
        self,
        publisher: Publisher,
        record: dict[str, Any],
        key: str | None,
        group: str | None,
        headers: dict[str, Any],
        body: Any,
        kwargs: dict[str, Any],
    ) -> Any:
        """A keyed retry: registered (with its copy when the outbox is on for the task), committed, then
        published. The retry goes out even if the ledger cannot register it (logged): the registration only lets a
        lost retry be found, it never holds one back."""
        try:
            self.stored = publisher.ledger.register_retry(
                self._task_id,
                self._attempt,
                record if self._keep_copy else None,
                task_name=self._task_name,
                key=key,
                group_key=group,
                eta=_eta(headers.get("eta")),
                arrival_timeout=arrival_timeout(publisher.settings, grouped=group is not None),
            )
        except Exception as exc:
            logger.warning(
                "celery-keyed: could not register retry %d of %s in the ledger (%s); publishing it unregistered",
                self._attempt,
                self._task_id,
                exc,
            )
            return self._producer.publish(body, **kwargs)
        if not (self.stored and self._keep_copy):
            return self._producer.publish(body, **kwargs)
        try:
            return self._producer.publish(body, **kwargs)
        except Exception as exc:
            logger.warning(
                "celery-keyed: publishing retry %d of %s failed (%s); its message is stored in the outbox and will be"
                " published by the relay when it is due",
                self._attempt,
                self._task_id,
                exc,
            )
            return None


@contextmanager
def outbox_producer(
    app: Any,
    options: dict[str, Any],
    *,
    task_id: str,
    task_name: str,
    connection: Any = None,
    attempt: int = 0,
    keep_copy: bool = True,
) -> Iterator[OutboxProducer]:
    """An :class:`OutboxProducer` around the producer Celery would use for ``options`` (its ``producer``, a
    producer on its broker ``connection``, else one from the app's pool); pops both from ``options``. ``attempt``:
    the retry number of a retry (registered by that attempt; ``keep_copy`` False: without its message)."""
    producer = options.pop("producer", None)
    broker = options.pop("connection", None)
    if producer is None and broker is not None:
        producer = app.amqp.Producer(broker, auto_declare=False)
    with app.producer_or_acquire(producer) as real:
        yield OutboxProducer(
            real, app, task_id=task_id, task_name=task_name, connection=connection, attempt=attempt,
            keep_copy=keep_copy,
        )


def arrival_timeout(settings: KeyedSettings, *, grouped: bool) -> float:
    """Seconds a registered message may take to arrive before the relay publishes it again:
    ``keyed_send_arrival_timeout``, and for a task of an ordered group at most half of
    ``keyed_group_arrival_timeout`` — a group number not received by then is recorded lost (D10), and a lost
    number is never republished."""
    if grouped:
        return min(settings.send_arrival_timeout, settings.group_arrival_timeout / 2)
    return settings.send_arrival_timeout


def relay_outbox(
    app: Any,
    ledger: Ledger,
    *,
    arrival_timeout: float,
    grouped_timeout: float | None = None,
    batch: int = 100,
    rounds: int = 10,
    now: datetime | None = None,
) -> dict[str, int]:
    """The outbox relay (the worker's sweep and beat's reconcile call it): publish every registration that is due —
    registered in a caller's transaction and committed since (``first``), or not received by any worker within
    its arrival timeout (``republished``, a warning each). A copy that arrives after an earlier one is a duplicate
    the worker drops (D8). A failed publish is logged (``failed``) and retried when the row is due again. At most
    ``rounds`` batches of ``batch``. ``grouped_timeout``: the arrival timeout of tasks of ordered groups
    (``arrival_timeout(settings, grouped=True)``)."""
    counts = {"first": 0, "republished": 0, "failed": 0}
    for _ in range(rounds):
        due = ledger.outbox_due(arrival_timeout=arrival_timeout, grouped_timeout=grouped_timeout, batch=batch, now=now)
        for entry in due:
            try:
                republish(app, entry.message, nonce=None)
            except Exception as exc:
                counts["failed"] += 1
                logger.warning("celery-keyed: could not publish %s from the outbox (%s)", entry.task_id, exc)
                continue
            if entry.republish:
                counts["republished"] += 1
                logger.warning(
                    "celery-keyed: %s (%s) was not received by any worker in time: published again from the outbox"
                    " (%d times so far)",
                    entry.task_id,
                    entry.task_name,
                    entry.republished,
                )
            else:
                counts["first"] += 1
        if len(due) < batch:
            break
    for kind, count in counts.items():
        metrics.outbox_published(kind, count)
    return counts


def _eta(value: Any) -> datetime | None:
    """The ``eta`` header (ISO 8601, or None) as a datetime: the outbox waits for a countdown before it counts."""
    if not isinstance(value, str):
        return value if isinstance(value, datetime) else None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def register_group(app: Any, group_key: str, task_id: str, connection: Any) -> int | None:
    """Allocate the group number of a call at publish (D10): on ``connection`` when the caller holds one, else on the
    app's ledger; None (ordered by receipt) when registration is off or the ledger cannot be reached — the call is
    still published, never lost."""
    from celery_keyed.ledger import groups_register

    if connection is not None:
        return groups_register(connection, group_key, task_id)
    publisher = publisher_for(app)
    if publisher is None or not publisher.settings.register_groups:
        return None
    try:
        with publisher.engine.begin() as conn:
            return groups_register(conn, group_key, task_id)
    except Exception as exc:  # the ledger is down: publish unregistered (ordered by receipt), do not fail
        logger.warning(
            "celery-keyed: could not register %s in group %s (%s); ordered by receipt", task_id, group_key, exc
        )
        return None
