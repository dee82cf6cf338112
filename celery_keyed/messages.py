"""Broker messages kept in the ledger while an attempt is parked, and brought back when it is promoted:
run here from the stored message (local handoff, D4) or republished with an admission nonce (D5)."""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kombu.message import Message
from kombu.serialization import dumps

from celery_keyed.headers import HEADER_NONCE

logger = logging.getLogger("celery_keyed")

#: Message properties worth keeping (the rest are per-delivery: delivery tags, body encoding…).
_KEPT_PROPERTIES = ("priority", "correlation_id", "reply_to")


def record_message(message: Any, *, task_name: str) -> dict[str, Any]:
    """A JSON-able record of a received message: enough to run it again or publish it again."""
    body = message.body
    if isinstance(body, str):
        body = body.encode("utf-8")
    delivery_info = message.delivery_info or {}
    properties = message.properties or {}
    # kombu decompressed the body when it built the message: the record keeps it plain, without the header that
    # would make a restored or republished copy be decompressed a second time.
    headers = {k: v for k, v in dict(message.headers or {}).items() if k not in (HEADER_NONCE, "compression")}
    return {
        "task": task_name,
        "body": base64.b64encode(bytes(body)).decode("ascii"),
        "content_type": message.content_type,
        "content_encoding": message.content_encoding,
        "headers": headers,
        "properties": {k: properties[k] for k in _KEPT_PROPERTIES if properties.get(k) is not None},
        "exchange": delivery_info.get("exchange") or "",
        "routing_key": delivery_info.get("routing_key") or "",
    }


def record_published(
    body: Any,
    *,
    task_name: str,
    exchange: Any,
    routing_key: str | None,
    headers: dict[str, Any] | None,
    serializer: str | None = None,
    compression: str | None = None,
    content_type: str | None = None,
    content_encoding: str | None = None,
    properties: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The record ``record_message`` makes of a received message, made at publish from the arguments Celery passes
    to ``Producer.publish`` (the outbox): the body serialized as kombu will send it, so the stored
    copy can be published again as it was — uncompressed, as a received message is recorded (``compression`` is
    accepted and left out: a copy is published without it)."""
    headers = {k: v for k, v in dict(headers or {}).items() if k not in (HEADER_NONCE, "compression")}
    if isinstance(body, bytes | str) and content_type is not None:
        data = body.encode(content_encoding or "utf-8") if isinstance(body, str) else body
        encoding = content_encoding or "binary"
    else:
        content_type, encoding, data = dumps(body, serializer=serializer)
        if isinstance(data, str):
            data = data.encode(encoding)
    properties = properties or {}
    return {
        "task": task_name,
        "body": base64.b64encode(bytes(data)).decode("ascii"),
        "content_type": content_type,
        "content_encoding": encoding,
        "headers": headers,
        "properties": {k: properties[k] for k in _KEPT_PROPERTIES if properties.get(k) is not None},
        "exchange": (getattr(exchange, "name", exchange) or "") if exchange is not None else "",
        "routing_key": routing_key or "",
    }


def restore_message(record: dict[str, Any], *, nonce: str | None = None) -> Message:
    """A kombu message rebuilt from its record, carrying the admission nonce, for the local strategy."""
    headers = dict(record["headers"])
    if nonce is not None:
        headers[HEADER_NONCE] = nonce
    return Message(
        body=base64.b64decode(record["body"]),
        content_type=record["content_type"],
        content_encoding=record["content_encoding"],
        headers=headers,
        properties=dict(record["properties"]),
        delivery_info={"exchange": record["exchange"], "routing_key": record["routing_key"], "redelivered": False},
    )


def republish(app: Any, record: dict[str, Any], *, nonce: str | None) -> None:
    """Publish a promoted attempt's stored message again, with its nonce (thread-safe: uses the pool); without a
    nonce for a message of the outbox: an ordinary arrival, as first published."""
    headers = dict(record["headers"])
    if nonce is not None:
        headers[HEADER_NONCE] = nonce
    with app.producer_pool.acquire(block=True) as producer:
        producer.publish(
            base64.b64decode(record["body"]),
            exchange=record["exchange"],
            routing_key=record["routing_key"],
            headers=headers,
            content_type=record["content_type"],
            content_encoding=record["content_encoding"],
            retry=True,
            **record["properties"],
        )


@dataclass
class Dispatched:
    """What ``publish_promoted`` did: promotions published, and those it could not publish (their task ids) with
    the last broker error. Promotions bound to a worker already (no nonce) are not published and not counted."""

    published: int = 0
    failed: list[str] = field(default_factory=list)
    error: BaseException | None = None


def publish_promoted(
    app: Any, promotions: Iterable[Any], *, on_published: Callable[[Any], None] | None = None
) -> Dispatched:
    """Publish each promoted attempt with its admission nonce, with the one policy for broker errors: the ledger
    change that made the promotion is committed already, and a promotion that cannot be published stays in the
    ledger and goes back in line after ``keyed_dispatch_timeout`` (the reaper voids its nonce) — so a broker error is
    a warning, counted in the report, never raised, and the other promotions are still published. Every caller that
    publishes promotions goes through here (``access.dispatch`` for beat, the CLI, the package API and the Django
    app; the worker's handoff for those it does not run itself). ``on_published``: called with each one published."""
    done = Dispatched()
    for promotion in promotions:
        if promotion.nonce is None:
            continue
        try:
            republish(app, promotion.message, nonce=str(promotion.nonce))
        except Exception as exc:  # the broker's errors are many (kombu, redis, amqp): any is the same here
            done.failed.append(promotion.task_id)
            done.error = exc
            logger.warning(
                "celery-keyed: could not publish promoted task %s (%s); it goes back in line after the dispatch"
                " timeout",
                promotion.task_id,
                exc,
            )
            continue
        done.published += 1
        if on_published is not None:
            on_published(promotion)
    return done


def context_from_record(record: dict[str, Any]) -> dict[str, Any]:
    """Request context (id, group, chord, errbacks…) of a stored message, for storing its result (D11)."""
    headers = record.get("headers") or {}
    context: dict[str, Any] = {
        "id": headers.get("id"),
        "task": headers.get("task"),
        "group": headers.get("group"),
        "group_index": headers.get("group_index"),
        "root_id": headers.get("root_id"),
        "parent_id": headers.get("parent_id"),
        "reply_to": (record.get("properties") or {}).get("reply_to"),
        "correlation_id": (record.get("properties") or {}).get("correlation_id"),
        "delivery_info": {},  # Celery's errback call reads it (a worker's request always has one)
    }
    if record.get("content_type") == "application/json":
        try:
            import json

            _args, _kwargs, embed = json.loads(base64.b64decode(record["body"]))
            context.update(
                chord=embed.get("chord"),
                callbacks=embed.get("callbacks"),
                errbacks=embed.get("errbacks"),
                chain=embed.get("chain"),
            )
        except (ValueError, TypeError):
            pass
    return context


#: How a republished copy of a fenced attempt is retried while the broker does not answer; bounded, because it is
#: sent from the consumer loop (the outcome hooks run there). A copy that cannot be sent leaves the attempt failed.
REPUBLISH_RETRY = {"max_retries": 3, "interval_start": 0.0, "interval_step": 0.5, "interval_max": 1.0}


def republish_received(app: Any, request: Any) -> None:
    """Publish the message ``request`` was received in again, as it was received (same task id, attempt and
    headers; no admission nonce), to the exchange and routing key it came by."""
    record = record_message(request._message, task_name=request.name)
    with app.producer_pool.acquire(block=True, timeout=10) as producer:
        producer.publish(
            base64.b64decode(record["body"]),
            exchange=record["exchange"],
            routing_key=record["routing_key"],
            headers=record["headers"],
            content_type=record["content_type"],
            content_encoding=record["content_encoding"],
            retry=True,
            retry_policy=REPUBLISH_RETRY,
            **record["properties"],
        )
