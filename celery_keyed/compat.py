"""Workarounds for bugs of the libraries below us. Nothing here changes behaviour when the bug does not show.

``patch_kombu_redis_close()``: a Celery worker on the Redis broker dies on a broker outage with
``Unrecoverable error: AttributeError("'NoneType' object has no attribute 'hostname'")``. Upstream, reproduced
with plain Celery 5.7.0 / kombu 5.7.0 (``tests/chaos/repro_kombu_close.py``):

1. On a connection error the consumer (``celery/worker/consumer/consumer.py``,
   ``on_connection_error_after_connected``) calls ``connection.collect(socket_timeout=...)`` and then
   ``ignore_errors(connection, connection.close)``; the second call is new (celery/celery#10242, the fix for
   celery/celery#9705).
2. ``kombu.Connection.collect()`` (the redis transport has no ``_collect``) closes the channels best effort:
   ``maybe_close_channel(default_channel)`` swallows connection errors, and the virtual transport's
   ``close_connection()`` stops at the first channel whose ``close()`` raises. The redis ``Channel.close()``
   does network I/O *before* it marks itself closed (it drains a pending ``BRPOP``, deletes fanout bindings),
   so with Redis down the default channel can stay open. ``collect()`` then detaches the transport anyway
   (``transport.client = None``) and leaves ``Connection._default_channel`` pointing at that channel.
3. ``connection.close()`` closes the default channel once more. ``_brpop_read`` reset ``_in_poll`` on the
   first attempt, so this time the close gets to ``QoS.restore_unacked_once()``; with unacknowledged
   messages (``acks_late``, prefetched tasks) it needs a new connection pool, and ``Channel._connparams()``
   reads ``self.connection.client.hostname`` from the detached transport: ``AttributeError``, which is
   neither a connection nor a channel error, so it passes through ``ignore_errors`` and kills the worker.

The workaround: ``Channel._connparams()`` remembers the parameters it computed while the transport was
attached, and a channel still open on a detached transport uses them, with socket timeouts bounded to
``DETACHED_SOCKET_TIMEOUT`` since that only happens during teardown.
The late close then restores the unacknowledged messages as kombu means it to (if Redis is back), or fails
with a ``redis.ConnectionError`` that kombu and Celery already ignore (if it is not); the messages then stay
in the ``unacked`` hash until the visibility timeout, exactly as when the first close fails. A channel that
never computed parameters for that pool kind raises ``redis.ConnectionError`` instead of ``AttributeError``.
Attached transports get the original method's result, untouched.

The same guard covers a channel closed for good (its ``connection`` is ``None``), where kombu raises
``AttributeError("'NoneType' object has no attribute 'client'")``: Celery acknowledges a task through
``hub.call_soon`` (``Consumer.call_soon_ack``), so an acknowledgement asked for just before a broker reconnect runs
after it, on the old message's closed channel. ``Message.ack_log_error`` forgives only connection errors, and the
ready queue's callbacks run unguarded in the consumer loop: the worker died with ``Unrecoverable error`` (``make
chaos``, seed 9, a task finished while Redis was restarting). The guard raises ``redis.ConnectionError`` instead,
which ``ack_log_error`` logs and forgives; the message was put back by the channel's close (or comes back after
the visibility timeout), and the ledger drops the second delivery of a task it has seen finish or start.

``patch_kombu_redis_restore_lock()``: on the Redis broker, no message of a dead worker is redelivered for five
minutes after a Redis restart or outage. Upstream, plain kombu 5.7.0 (``tests/test_compat_restore_lock.py``
shows it on unpatched kombu):

1. Every worker redelivers the unacked messages older than ``visibility_timeout`` (``QoS.restore_visible``,
   every ``unacked_restore_interval``) under one lock in Redis, kombu's ``Mutex`` over redis-py's ``Lock``, with
   an expiry of ``unacked_mutex_expire`` (300 s by default).
2. ``Mutex`` releases the lock in a ``finally`` that forgives only ``LockNotOwnedError``. When Redis goes away
   while a worker holds the lock (a restart, an outage, a dropped connection), the release fails with a
   ``ConnectionError`` and the lock stays: Redis persisted it, so once back it refuses every worker's scan until
   the expiry. A lock taken by a ``SET`` whose reply was lost is left the same way (its token unknown).
3. Meanwhile the messages of a worker that was killed or lost its connection wait in the ``unacked`` hash: the
   chaos harness saw three tasks wait five minutes after a 6 s Redis outage (CI, seed 9).

The workaround: ``Mutex`` takes the lock with a token of its own and, when the release (or the acquire) fails
with a connection error, remembers the token; its next use in the process (the next scan) first deletes the
lock if it still holds that token (a compare-and-delete in one Lua script: a lock taken since by another worker
is never touched), so the lock is gone one scan after Redis is back. A worker killed while it holds the lock still
leaves it until ``unacked_mutex_expire``: set that to tens of seconds (docs/guide.md, *Redis broker*).

``patch_celery_untracked_child()``: a prefork worker dies at a broker reconnect with ``Unrecoverable error:
ValueError('file descriptor is None')`` when a pool process that exited is still in the pool's list. Upstream,
Celery 5.7.0 (``tests/unit/test_compat_untracked_child.py`` shows it on a real ``AsynPool``):

1. When a pool process exits, ``AsynPool._event_process_exit`` stops watching it (``_untrack_child_process``
   closes its sentinel's duplicate and sets ``proc._sentinel_poll = None``) and calls ``maintain_pool``, which
   removes and replaces it only once its exit code can be read; otherwise the next ``maintain_pool`` (a 5 s timer)
   does.
2. A broker reconnect in between (the consumer restarts and registers the pool with the event loop again) runs
   ``_track_child_process`` for every process of the list. For the exited one it reads ``_sentinel_poll``, finds
   ``None`` (the attribute is there, so no new duplicate is made) and hands it to ``hub.add_reader``, which raises
   ``ValueError``; ``iterate_file_descriptors_safely`` forgives only ``OSError``, ``FileNotFoundError`` and
   ``AttributeError``, so the consumer's start fails and the worker exits. The gate terminates pool processes
   (self-fencing, newest-wins cancels), which makes such an exit next to a Redis outage likelier than in plain
   Celery: ``make chaos`` saw it once (a worker exited with status 1 when Redis came back after an outage).

The workaround: ``_track_child_process`` leaves a process alone when its sentinel was already untracked (its exit
was handled); ``maintain_pool``, which the same registration schedules every 5 s, removes and replaces it as it
would have. Every other process is tracked by Celery's own method.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import uuid
from collections.abc import Iterator
from typing import Any

__all__ = [
    "DETACHED_SOCKET_TIMEOUT",
    "KOMBU_FIXED_IN",
    "kombu_redis_close_affected",
    "kombu_redis_restore_lock_affected",
    "patch_celery_untracked_child",
    "patch_kombu_redis_close",
    "patch_kombu_redis_restore_lock",
]

#: Socket (connect) timeout, in seconds, for the pools a channel builds after its transport was detached:
#: teardown must not block on an unreachable broker (the same bound as Celery's ``COLLECT_SOCKET_TIMEOUT``).
DETACHED_SOCKET_TIMEOUT = 5.0

#: First kombu release with the bug fixed (``None``: none known). From it on the patch is not applied.
KOMBU_FIXED_IN: tuple[int, ...] | None = None

_MARK = "__celery_keyed_detached_guard__"
_CACHE = "_celery_keyed_connparams"
_lock = threading.Lock()


def _kombu_version() -> tuple[int, ...]:
    import kombu

    parts = []
    for part in str(kombu.__version__).split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def kombu_redis_close_affected() -> bool:
    """Whether the installed kombu has the bug: a redis transport whose ``Channel._connparams`` reads
    ``self.connection.client`` unguarded, in a release before ``KOMBU_FIXED_IN``."""
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:  # no redis-py: no redis transport to patch
        return False
    version = _kombu_version()
    if version < (5, 0) or (KOMBU_FIXED_IN is not None and version >= KOMBU_FIXED_IN):
        return False
    method = getattr(kombu_redis.Channel, "_connparams", None)
    if method is None:
        return False
    method = inspect.unwrap(method)
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return "self.connection.client" in source


def _bounded(params: dict[str, Any]) -> dict[str, Any]:
    params = dict(params)
    for key in ("socket_timeout", "socket_connect_timeout"):
        value = params.get(key)
        if value is None or value > DETACHED_SOCKET_TIMEOUT:
            params[key] = DETACHED_SOCKET_TIMEOUT
    return params


def _guard(original: Any) -> Any:
    @functools.wraps(original)
    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        transport = getattr(self, "connection", None)
        if transport is None:
            import redis

            raise redis.exceptions.ConnectionError(
                "kombu redis channel: closed (its connection was replaced); an acknowledgement or restore asked of "
                "it now is dropped, and its unacknowledged messages come back to the queue"
            )
        if getattr(transport, "client", None) is not None:  # attached: kombu's own result, remembered
            params = original(self, asynchronous=asynchronous)
            self.__dict__.setdefault(_CACHE, {})[bool(asynchronous)] = dict(params)
            return params
        remembered = self.__dict__.get(_CACHE, {}).get(bool(asynchronous))
        if remembered is None:
            import redis

            raise redis.exceptions.ConnectionError(
                "kombu redis channel: the transport was detached from its connection (closed) before this "
                "channel connected; nothing to reconnect with"
            )
        return _bounded(remembered)

    setattr(_connparams, _MARK, True)
    return _connparams


def patch_kombu_redis_close(*, force: bool = False) -> bool:
    """Guard kombu's redis ``Channel._connparams`` against a detached transport (see the module docstring).

    Idempotent and process-wide; call it before the worker's consumer connects (``install(app)`` does).
    Applied only when ``kombu_redis_close_affected()`` (or ``force``). Returns whether the guard is in place.
    """
    with _lock:
        try:
            from kombu.transport import redis as kombu_redis
        except ImportError:
            return False
        current = kombu_redis.Channel.__dict__.get("_connparams")
        if current is None:
            return False
        if getattr(current, _MARK, False):
            return True
        if not (force or kombu_redis_close_affected()):
            return False
        setattr(kombu_redis.Channel, "_connparams", _guard(current))  # noqa: B010 - a method, not a field
        return True


# ----------------------------------------------------------------------------------------------------
# The restore lock (see the module docstring).

_LOCK_MARK = "__celery_keyed_restore_lock__"
#: Compare-and-delete: drop the lock only while it still holds the given token.
_DELETE_IF_OURS = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
#: Tokens per lock kept for a later release; a lock expires anyway, so older ones are dropped past this many.
_STALE_KEEP = 16
_stale: dict[tuple[Any, ...], list[bytes]] = {}
_stale_lock = threading.Lock()


def kombu_redis_restore_lock_affected() -> bool:
    """Whether the installed kombu's redis ``Mutex`` leaves its lock set when the release fails on a connection
    error: it forgives ``LockNotOwnedError`` only."""
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:
        return False
    mutex = getattr(kombu_redis, "Mutex", None)
    if mutex is None or getattr(mutex, _LOCK_MARK, False):
        return False
    try:
        source = inspect.getsource(inspect.unwrap(mutex))
    except (OSError, TypeError):
        return False
    return "LockNotOwnedError" in source and "ConnectionError" not in source


def _lock_site(client: Any, name: Any) -> tuple[Any, ...]:
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {}) or {}
    return (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"), kwargs.get("db"), name)


def _remember_stale(site: tuple[Any, ...], token: bytes) -> None:
    with _stale_lock:
        tokens = _stale.setdefault(site, [])
        tokens.append(token)
        del tokens[:-_STALE_KEEP]


def _release_stale(client: Any, site: tuple[Any, ...], name: Any) -> None:
    """Delete the lock ``name`` if it still holds a token this process failed to release; tokens whose fate is
    known (deleted, or the lock is not theirs) are forgotten; on a connection error they are kept for next time."""
    import redis

    with _stale_lock:
        tokens = list(_stale.get(site, ()))
    for token in tokens:
        try:
            client.eval(_DELETE_IF_OURS, 1, name, token)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            return  # Redis still away: next time
        except redis.exceptions.RedisError:
            pass  # refused (a read-only replica, no scripting): never raised into kombu's scan; left to its expiry
        with _stale_lock:
            left = _stale.get(site, [])
            if token in left:
                left.remove(token)
            if not left:
                _stale.pop(site, None)


def _mutex(original: Any) -> Any:
    @contextlib.contextmanager
    def Mutex(client: Any, name: Any, expire: Any) -> Iterator[None]:  # kombu's name
        import redis
        from kombu.transport.redis import MutexHeld

        connection_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        site = _lock_site(client, name)
        _release_stale(client, site, name)
        lock = client.lock(name, timeout=expire)
        token = uuid.uuid4().hex.encode()
        try:
            acquired = lock.acquire(blocking=False, token=token)
        except connection_errors:
            _remember_stale(site, token)  # the SET may have taken the lock before its reply was lost
            raise
        if not acquired:
            raise MutexHeld()
        try:
            yield
        finally:
            try:
                lock.release()
            except redis.exceptions.LockNotOwnedError:
                pass  # expired meanwhile (as kombu)
            except connection_errors:
                _remember_stale(site, token)
                raise

    setattr(Mutex, _LOCK_MARK, True)
    Mutex.kombu_mutex = original  # type: ignore[attr-defined]
    return Mutex


def patch_kombu_redis_restore_lock(*, force: bool = False) -> bool:
    """Replace kombu's redis ``Mutex`` with one that frees a lock it could not release once Redis is back (see
    the module docstring). Idempotent and process-wide; ``install(app)`` calls it. Applied only when
    ``kombu_redis_restore_lock_affected()`` (or ``force``). Returns whether the replacement is in place."""
    with _lock:
        try:
            from kombu.transport import redis as kombu_redis
        except ImportError:
            return False
        current = getattr(kombu_redis, "Mutex", None)
        if current is None:
            return False
        if getattr(current, _LOCK_MARK, False):
            return True
        if not (force or kombu_redis_restore_lock_affected()):
            return False
        kombu_redis.Mutex = _mutex(current)
        return True


_CHILD_MARK = "__celery_keyed_untracked_child__"


def patch_celery_untracked_child() -> bool:
    """Make Celery's prefork pool skip, when it registers with the event loop again, a pool process whose exit it
    has already handled (see the module docstring). Idempotent and process-wide; ``install(app)`` calls it.
    Returns whether the replacement is in place (False without Celery's prefork pool)."""
    with _lock:
        try:
            from celery.concurrency import asynpool
        except ImportError:  # pragma: no cover - billiard missing: no prefork pool
            return False
        pool_class = asynpool.AsynPool
        original = pool_class._track_child_process
        if getattr(original, _CHILD_MARK, False):
            return True

        @functools.wraps(original)
        def _track_child_process(self: Any, proc: Any, hub: Any) -> Any:
            if getattr(proc, "_sentinel_poll", False) is None:
                # untracked by _event_process_exit / on_process_down: it exited, and maintain_pool replaces it
                return None
            return original(self, proc, hub)

        setattr(_track_child_process, _CHILD_MARK, True)
        _track_child_process.celery_original = original  # type: ignore[attr-defined]
        pool_class._track_child_process = _track_child_process
        return True
