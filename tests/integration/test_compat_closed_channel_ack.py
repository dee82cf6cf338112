"""celery_keyed.compat.patch_kombu_redis_close: an acknowledgement that runs after its channel was closed.

Celery acknowledges through ``hub.call_soon``; when the broker connection is replaced in between (a Redis restart),
the ack runs on the old message's closed channel. On a real Redis: a message received and not acknowledged, its
connection closed (kombu puts the message back), then Celery's own ``ack_log_error`` with the connection errors
Celery passes it. The worker that died (``make chaos``, seed 9) acked on a closed channel whose connection pool was
gone too (its close dropped the pools and rebuilt none: nothing left to restore on it); the test drops the pool
the same way, since a clean close rebuilds it to restore the message. Without the guard kombu raises
``AttributeError`` (which killed the worker from the consumer loop); with it the ack is logged and dropped, and the
message is delivered again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

redis = pytest.importorskip("redis")
kombu_redis = pytest.importorskip("kombu.transport.redis")

from kombu import Connection, Exchange, Queue  # noqa: E402

from celery_keyed import compat  # noqa: E402

logger = logging.getLogger("test_compat_closed_channel_ack")


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """kombu's own ``_connparams`` for the test; ``guard()`` puts the workaround on top."""
    import inspect

    original = inspect.unwrap(kombu_redis.Channel.__dict__["_connparams"])
    monkeypatch.setattr(kombu_redis.Channel, "_connparams", original)
    yield lambda: compat.patch_kombu_redis_close(force=True)


def _received_unacked(url: str, name: str) -> tuple[Connection, Any]:
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    conn = Connection(url)
    with conn.Producer() as producer:
        producer.publish({"n": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
    simple = conn.SimpleQueue(queue)
    message = simple.get(timeout=5)
    assert message.payload == {"n": 1}
    return conn, message


def _delivered_again(url: str, name: str) -> Any:
    with Connection(url) as conn:
        simple = conn.SimpleQueue(Queue(name, Exchange(name, type="direct"), routing_key=name))
        message = simple.get(timeout=5)
        message.ack()
        return message.payload


def test_kombu_raises_attribute_error_on_an_ack_after_its_connection_was_replaced(redis_url: str, guard: Any) -> None:
    conn, message = _received_unacked(redis_url, "closed-ack-unpatched")
    errors = conn.connection_errors
    conn.close()  # the consumer's reconnect: the channel is closed for good, its unacked message restored
    message.channel._disconnect_pools()  # as in the crash: no pool left on the closed channel
    with pytest.raises(AttributeError):
        message.ack_log_error(logger, errors)


def test_the_guard_turns_the_late_ack_into_a_forgiven_connection_error(
    redis_url: str, guard: Any, caplog: pytest.LogCaptureFixture
) -> None:
    assert guard()
    conn, message = _received_unacked(redis_url, "closed-ack")
    errors = conn.connection_errors
    conn.close()
    message.channel._disconnect_pools()
    with caplog.at_level(logging.CRITICAL, logger=logger.name):
        message.ack_log_error(logger, errors)  # as Celery's ready queue runs it: must not raise
    assert "Couldn't ack" in caplog.text
    assert _delivered_again(redis_url, "closed-ack") == {"n": 1}  # nothing lost: delivered again


def test_a_late_reject_is_forgiven_too(redis_url: str, guard: Any) -> None:
    assert guard()
    conn, message = _received_unacked(redis_url, "closed-reject")
    errors = conn.connection_errors
    conn.close()
    message.channel._disconnect_pools()
    message.reject_log_error(logger, errors, requeue=True)
    assert _delivered_again(redis_url, "closed-reject") == {"n": 1}
