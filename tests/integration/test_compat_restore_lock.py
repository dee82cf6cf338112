"""celery_keyed.compat.patch_kombu_redis_restore_lock: kombu's redis restore lock after Redis went away.

A real Redis of the test's own (persistent, so an outage keeps its data as a production broker's does), stopped
and started again while the lock is held; kombu's own ``QoS.restore_visible`` is what must get the dead
consumer's message back once Redis is up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

redis = pytest.importorskip("redis")
kombu_redis = pytest.importorskip("kombu.transport.redis")

from kombu import Connection  # noqa: E402

from celery_keyed import compat  # noqa: E402
from celery_keyed.testing import RedisServer, start_redis  # noqa: E402

LOCK = "unacked_mutex"  # kombu's default unacked_mutex_key


@pytest.fixture
def server() -> Iterator[RedisServer]:
    started = start_redis(use_env=False, persistent=True)
    assert isinstance(started, RedisServer)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def kombu_mutex(monkeypatch: pytest.MonkeyPatch) -> Any:
    """kombu's own ``Mutex`` in place for the test (whatever an earlier ``install()`` put there comes back after)."""
    original = getattr(kombu_redis.Mutex, "kombu_mutex", kombu_redis.Mutex)
    monkeypatch.setattr(kombu_redis, "Mutex", original)
    compat._stale.clear()
    yield original
    compat._stale.clear()


def _client(server: RedisServer) -> Any:
    return redis.Redis.from_url(server.url_for(0), socket_timeout=5)


def _outage_while_held(server: RedisServer, client: Any) -> None:
    """Take the lock through ``kombu_redis.Mutex`` and lose Redis before the release (stopped, then started again
    with the same files): the release fails on a connection error, as in a worker's scan during an outage."""
    with pytest.raises(redis.exceptions.ConnectionError), kombu_redis.Mutex(client, LOCK, 300):
        server.suspend()
    server.resume()


@pytest.mark.skipif(not compat.kombu_redis_restore_lock_affected(), reason="this kombu releases its lock itself")
def test_unpatched_kombu_keeps_its_restore_lock_for_its_whole_expiry_after_an_outage(
    server: RedisServer, kombu_mutex: Any
) -> None:
    client = _client(server)
    _outage_while_held(server, _client(server))
    assert client.pttl(LOCK) > 250_000  # five minutes without a redelivery of a dead worker's message
    with pytest.raises(kombu_redis.MutexHeld), kombu_redis.Mutex(client, LOCK, 300):
        pass


def test_the_next_scan_after_an_outage_frees_the_lock_and_redelivers_a_dead_consumers_message(
    server: RedisServer, kombu_mutex: Any
) -> None:
    assert compat.patch_kombu_redis_restore_lock(force=True)
    options = {"visibility_timeout": 0.2}
    dead = Connection(server.url_for(0), transport_options=options)
    queue = dead.SimpleQueue("work")
    queue.put({"n": 1})
    message = queue.get(timeout=5)  # received, never acked: the consumer is about to die
    assert message.payload == {"n": 1}

    _outage_while_held(server, _client(server))
    client = _client(server)
    assert client.pttl(LOCK) > 0  # still set: Redis persisted it

    time.sleep(0.3)  # past the visibility timeout
    alive = Connection(server.url_for(0), transport_options=options)
    alive.default_channel.qos.restore_visible(num=None, interval=1)  # kombu's own scan, in another worker
    assert client.pttl(LOCK) == -2  # freed, and released again after the scan
    redelivered = alive.SimpleQueue("work").get(timeout=5)
    assert redelivered.payload == {"n": 1}
    redelivered.ack()
    for conn in (dead, alive):
        conn.release()


def test_a_lock_another_worker_took_since_is_left_alone(server: RedisServer, kombu_mutex: Any) -> None:
    assert compat.patch_kombu_redis_restore_lock(force=True)
    _outage_while_held(server, _client(server))
    client = _client(server)
    client.delete(LOCK)  # expired, say; then another worker took it
    client.set(LOCK, b"another-worker", px=300_000)
    with pytest.raises(kombu_redis.MutexHeld), kombu_redis.Mutex(client, LOCK, 300):
        pass
    assert client.get(LOCK) == b"another-worker"
    assert not compat._stale  # its token was settled: never tried again


def test_a_lock_whose_acquire_reply_was_lost_is_freed_by_the_next_use(
    server: RedisServer, kombu_mutex: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert compat.patch_kombu_redis_restore_lock(force=True)
    client = _client(server)
    real = redis.lock.Lock.do_acquire

    def lost_reply(self: Any, token: Any) -> bool:
        real(self, token)  # the SET took the lock ...
        raise redis.exceptions.ConnectionError("Connection closed by server.")  # ... and its reply never came

    monkeypatch.setattr(redis.lock.Lock, "do_acquire", lost_reply)
    with pytest.raises(redis.exceptions.ConnectionError), kombu_redis.Mutex(client, LOCK, 300):
        pytest.fail("the lock was not reported taken")
    monkeypatch.setattr(redis.lock.Lock, "do_acquire", real)
    assert client.pttl(LOCK) > 0
    with kombu_redis.Mutex(client, LOCK, 300):
        assert client.pttl(LOCK) > 0  # ours now
    assert client.pttl(LOCK) == -2


def test_patching_is_idempotent_and_keeps_kombus_function(kombu_mutex: Any) -> None:
    assert compat.patch_kombu_redis_restore_lock(force=True)
    patched = kombu_redis.Mutex
    assert compat.patch_kombu_redis_restore_lock()
    assert kombu_redis.Mutex is patched
    assert patched.kombu_mutex is kombu_mutex
    assert not compat.kombu_redis_restore_lock_affected()  # patched: nothing left to fix
