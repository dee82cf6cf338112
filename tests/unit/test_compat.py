"""celery_keyed.compat.patch_kombu_redis_close: kombu's redis channel closed after its transport was detached.

Server-free: kombu objects on a URL nothing listens on, ``PING`` stubbed, and the two network steps of the
scenario (a pending ``BRPOP`` that fails while Redis is down, the restore of an unacknowledged message)
replaced on the channel instances. The scenario is the one a Celery 5.7 worker goes through on a broker
outage: ``connection.collect()`` then ``connection.close()`` (celery/worker/consumer/consumer.py,
``on_connection_error_after_connected``); see ``tests/chaos/repro_kombu_close.py`` for the real thing.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest

redis = pytest.importorskip("redis")
kombu_redis = pytest.importorskip("kombu.transport.redis")

from kombu import Connection  # noqa: E402

from celery_keyed import compat  # noqa: E402

URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1: any real network call fails at once


@pytest.fixture(autouse=True)
def _unpatched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts from kombu's own ``_connparams``; whatever was there before is put back after."""
    original = inspect.unwrap(kombu_redis.Channel.__dict__["_connparams"])
    monkeypatch.setattr(kombu_redis.Channel, "_connparams", original)
    monkeypatch.setattr(redis.Redis, "ping", lambda self, **kwargs: True)
    yield


def _brpop_fails(channel: Any) -> Any:
    def _brpop_read(**options: Any) -> None:  # what kombu's does with Redis gone: reset _in_poll, raise
        channel._in_poll = None
        raise redis.exceptions.ConnectionError("Connection closed by server.")

    return _brpop_read


def _broken_connection(restored: list[str]) -> tuple[Connection, Any]:
    """A connection whose default channel holds an unacknowledged message, with a BRPOP pending on it and
    on a second channel (the worker's pidbox channel) when Redis goes away; ``collect()`` done."""
    conn = Connection(URL)
    channel = conn.default_channel
    channel.pool  # noqa: B018 - the channel has talked to Redis (as when it delivered the message)
    other = conn.channel()
    channel.qos.restore_by_tag = lambda tag, client=None, leftmost=False: restored.append(tag)
    channel.qos._delivered["tag-1"] = object()
    for chan in (channel, other):
        chan._in_poll = True
        chan._brpop_read = _brpop_fails(chan)
    conn.collect(socket_timeout=1)
    return conn, channel


def test_kombu_leaves_the_default_channel_open_on_a_detached_transport() -> None:
    if not compat.kombu_redis_close_affected():
        pytest.skip("this kombu is not affected")
    conn, channel = _broken_connection([])
    assert conn._default_channel is channel and not channel.closed
    assert channel.connection.client is None  # detached by collect()
    with pytest.raises(AttributeError, match="hostname"):  # the worker's "Unrecoverable error"
        conn.close()


def test_the_guard_lets_the_late_close_restore_the_unacked_message() -> None:
    assert compat.patch_kombu_redis_close(force=True)
    restored: list[str] = []
    conn, channel = _broken_connection(restored)
    conn.close()
    assert channel.closed
    assert restored == ["tag-1"]


def test_the_late_close_with_redis_down_raises_only_ignored_errors() -> None:
    assert compat.patch_kombu_redis_close(force=True)
    conn, channel = _broken_connection([])
    del channel.qos.restore_by_tag  # the real restore: connection refused
    conn.close()  # maybe_close_channel ignores the redis ConnectionError
    assert channel.closed


def test_detached_pools_get_bounded_socket_timeouts() -> None:
    assert compat.patch_kombu_redis_close(force=True)
    conn = Connection(URL, transport_options={"socket_timeout": 120})
    channel = conn.default_channel
    attached = channel._connparams()
    assert attached["socket_timeout"] == 120
    conn._do_close_transport()
    detached = channel._connparams()
    assert detached["socket_timeout"] == compat.DETACHED_SOCKET_TIMEOUT
    assert detached["socket_connect_timeout"] == compat.DETACHED_SOCKET_TIMEOUT
    assert {k: v for k, v in detached.items() if not k.startswith("socket_")} == {
        k: v for k, v in attached.items() if not k.startswith("socket_")
    }


def test_attached_transports_get_kombus_result_untouched() -> None:
    conn = Connection(URL)
    channel = conn.default_channel
    before = channel._connparams()
    compat.patch_kombu_redis_close(force=True)
    assert channel._connparams() == before
    ours = channel._connparams(asynchronous=True)
    theirs = inspect.unwrap(kombu_redis.Channel._connparams)(channel, asynchronous=True)
    assert ours.pop("connection_class").__qualname__ == theirs.pop("connection_class").__qualname__  # made per call
    assert ours == theirs


def test_a_channel_that_never_computed_its_parameters_raises_a_connection_error() -> None:
    assert compat.patch_kombu_redis_close(force=True)
    conn = Connection(URL)
    channel = conn.default_channel  # only the asynchronous pool exists (PING)
    conn._do_close_transport()
    with pytest.raises(redis.exceptions.ConnectionError):
        channel._connparams()
    assert issubclass(redis.exceptions.ConnectionError, Connection(URL).connection_errors)  # ignored by close


def test_patching_is_idempotent() -> None:
    assert compat.patch_kombu_redis_close(force=True)
    first = kombu_redis.Channel.__dict__["_connparams"]
    assert compat.patch_kombu_redis_close(force=True)
    assert compat.patch_kombu_redis_close()
    assert kombu_redis.Channel.__dict__["_connparams"] is first
    assert not getattr(first.__wrapped__, compat._MARK, False)  # wrapped once


def test_applied_only_to_affected_kombu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "KOMBU_FIXED_IN", (0, 1))
    assert not compat.kombu_redis_close_affected()
    assert not compat.patch_kombu_redis_close()
    assert not hasattr(kombu_redis.Channel.__dict__["_connparams"], "__wrapped__")


def test_a_channel_closed_for_good_raises_a_connection_error_not_attribute_error() -> None:
    conn = Connection(URL)
    channel = conn.default_channel
    channel.pool  # noqa: B018
    conn.close()
    assert channel.connection is None
    with pytest.raises(AttributeError):  # kombu's own: not an error Celery's ack_log_error forgives
        channel._connparams()
    assert compat.patch_kombu_redis_close(force=True)
    with pytest.raises(redis.exceptions.ConnectionError):
        channel._connparams()
    assert issubclass(redis.exceptions.ConnectionError, Connection(URL).connection_errors)
