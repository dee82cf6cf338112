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
``DETACHED_SOCKET_TIMEOUT`` since that only happens during teardown. (A channel closed for good, whose
``connection`` is ``None``, is left to kombu's own behaviour.)
The late close then restores the unacknowledged messages as kombu means it to (if Redis is back), or fails
with a ``redis.ConnectionError`` that kombu and Celery already ignore (if it is not); the messages then stay
in the ``unacked`` hash until the visibility timeout, exactly as when the first close fails. A channel that
never computed parameters for that pool kind raises ``redis.ConnectionError`` instead of ``AttributeError``.
Attached transports get the original method's result, untouched.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

__all__ = ["DETACHED_SOCKET_TIMEOUT", "KOMBU_FIXED_IN", "kombu_redis_close_affected", "patch_kombu_redis_close"]

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
        if transport is None or getattr(transport, "client", None) is not None:
            # Attached (remember the result), or a channel closed for good (kombu's own error, as before).
            params = original(self, asynchronous=asynchronous)
            if transport is not None:
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
