"""celery-keyed: keyed concurrency for Celery, backed by a Postgres slot ledger.

import celery_keyed
from celery_keyed import keyed_task

app.conf.keyed_database_url = "postgresql+psycopg://..."
app.conf.keyed_concurrency_limits = {"stripe": {"limit": 100, "shards": 10}}
celery_keyed.install(app)

@keyed_task(concurrency_key="account:{account_id}")
def sync_account(account_id): ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_keyed.exceptions import (
    KeyedCancelled,
    KeyedDeadLettered,
    KeyedExpired,
    KeyedLost,
    KeyedOutcome,
    KeyedRejected,
    KeyedRevoked,
    KeyedSuperseded,
)

if TYPE_CHECKING:
    from celery import Celery

    from celery_keyed.task import KeyedTask, keyed_task

__version__ = "0.1.0"

__all__ = [
    "KeyedCancelled",
    "KeyedDeadLettered",
    "KeyedExpired",
    "KeyedLost",
    "KeyedOutcome",
    "KeyedRejected",
    "KeyedRevoked",
    "KeyedSuperseded",
    "KeyedTask",
    "__version__",
    "clear_key_limit",
    "clear_limit",
    "install",
    "keyed_task",
    "pause_key",
    "resume_key",
    "revoke",
    "set_key_limit",
    "set_limit",
]


def __getattr__(name: str) -> Any:
    # The Celery side is imported on first use, so that ``celery_keyed.ledger`` (pure Postgres) can be used
    # without importing Celery.
    if name in ("KeyedTask", "keyed_task"):
        from celery_keyed import task

        return getattr(task, name)
    raise AttributeError(f"module 'celery_keyed' has no attribute {name!r}")


def install(app: Celery) -> None:
    """Install the gate on ``app``: the consumer bootstep (which also makes the worker's revoke command reach
    the ledger), the reconciler beat task and its schedule. Call it once, where the app is defined (before
    workers or beat start). A running task that is revoked is released by its request's failure hook."""
    if getattr(app, "_keyed_installed", False):
        return
    app._keyed_installed = True
    from celery_keyed.compat import (
        patch_celery_untracked_child,
        patch_kombu_redis_close,
        patch_kombu_redis_restore_lock,
    )

    # kombu's Redis transport kills the worker when it closes a channel twice after a broker outage, and stops
    # redelivering dead workers' messages for five minutes after one; Celery's prefork pool kills it at a broker
    # reconnect right after a pool process exited (plain Celery too): celery_keyed/compat.py.
    patch_kombu_redis_close()
    patch_kombu_redis_restore_lock()
    patch_celery_untracked_child()
    from celery_keyed.beat import RECONCILE_TASK, reconcile
    from celery_keyed.bootstep import KeyedGate

    app.steps["consumer"].add(KeyedGate)

    @app.task(name=RECONCILE_TASK, ignore_result=True, shared=False)
    def reconcile_task() -> dict[str, Any]:
        return reconcile(app)

    def _schedule(sender: Any, **kwargs: Any) -> None:
        from celery_keyed.ledger import check_seconds

        interval = check_seconds(sender.conf.get("keyed_reconcile_schedule") or 30.0, "keyed_reconcile_schedule")
        sender.add_periodic_task(interval, reconcile_task.s(), name=RECONCILE_TASK)

    if app.configured:
        _schedule(app)
    else:
        app.on_after_configure.connect(_schedule, weak=False)


def _ledger(app: Any) -> Any:
    from celery_keyed.access import ledger_for

    return ledger_for(app)


def _dispatch(app: Any, promotions: list[Any]) -> None:
    from celery_keyed.access import dispatch

    dispatch(app, promotions)


def set_limit(
    app: Any, name: str, limit: int, *, reason: str, author: str = "", expires_at: Any = None, connection: Any = None
) -> None:
    """Override the limit of ``name`` at runtime (0 pauses). With ``connection`` (an open SQLAlchemy
    connection in a transaction) the override commits or rolls back with the caller's own work; promotions it
    causes are then made by the sweepers within one sweep interval."""
    from celery_keyed.ledger import set_override

    if connection is not None:
        set_override(connection, name, limit, reason=reason, author=author, expires_at=expires_at)
        return
    _dispatch(app, _ledger(app).set_override(name, limit, reason=reason, author=author, expires_at=expires_at))


def clear_limit(app: Any, name: str, *, reason: str = "", author: str = "", connection: Any = None) -> None:
    """Remove the override of ``name``: its configured limit applies again."""
    from celery_keyed.ledger import clear_override

    if connection is not None:
        clear_override(connection, name, reason=reason, author=author)
        return
    _dispatch(app, _ledger(app).clear_override(name, reason=reason, author=author))


def pause_key(app: Any, key: str, seconds: float, *, reason: str, author: str = "") -> Any:
    """Pause one key (not its whole name) for ``seconds``: nothing new of the key starts before then, cluster-wide;
    running tasks go on; its waiting tasks keep their places and start when the pause ends. Only ever extends a
    pause. Returns the end of the pause in force (a ``datetime``). Inside a task: ``self.keyed_pause(seconds)``."""
    until, _ = _ledger(app).pause_key(key, seconds, reason=reason, author=author)
    return until


def resume_key(app: Any, key: str, *, reason: str = "", author: str = "") -> bool:
    """End the pause of ``key`` now (its waiting tasks start); False when it was not paused."""
    promotions = _ledger(app).resume_key(key, reason=reason, author=author)
    _dispatch(app, promotions or [])
    return promotions is not None


def set_key_limit(
    app: Any,
    key: str,
    limit: int,
    *,
    reason: str,
    author: str = "",
    expires_in: float | None = None,
    expires_at: Any = None,
) -> None:
    """Give one key a limit of its own (it replaces its name's limit for that key; 0 stops it), for ``expires_in``
    seconds or until ``expires_at`` (neither: until cleared). Inside a task: ``self.keyed_set_limit(n)``."""
    _dispatch(
        app,
        _ledger(app).set_key_limit(
            key, limit, reason=reason, author=author, expires_in=expires_in, expires_at=expires_at
        ),
    )


def clear_key_limit(app: Any, key: str, *, reason: str = "", author: str = "") -> bool:
    """Remove the key's own limit (its name's applies again); False when it had none."""
    promotions = _ledger(app).clear_key_limit(key, reason=reason, author=author)
    _dispatch(app, promotions or [])
    return promotions is not None


def revoke(app: Any, task_id: str, **kwargs: Any) -> None:
    """Revoke a task everywhere: Celery's revoke for running or reserved copies, and the ledger for a parked
    one (Celery's in-memory revoke list expires; the ledger's record does not, D11). A task id that is not a non-empty
    str is ``InvalidKey``, before anything is sent; one the ledger cannot hold (too long, a NUL) is never parked there,
    so only Celery's revoke is sent."""
    from celery_keyed.ledger import InvalidKey, validate_task_id

    if not isinstance(task_id, str) or not task_id:
        raise InvalidKey(f"the task id must be a non-empty str, got {task_id!r:.100}")
    app.control.revoke(task_id, **kwargs)
    try:
        validate_task_id(task_id)
    except InvalidKey:
        return
    _dispatch(app, _ledger(app).revoke(task_id))
