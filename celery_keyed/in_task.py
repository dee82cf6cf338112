"""What a keyed task's body can do about its own call while it runs: see whether a newer call cancelled it
(``keyed_cancelled``), give its slots back early (``release_concurrency``), pause its own key or give it a limit
(``keyed_pause``, ``keyed_set_limit``). A mixin of :class:`~celery_keyed.task.KeyedTask`; none of it is used at
publish.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from celery import Task

from celery_keyed.call_keys import evaluate_keys, key_spec
from celery_keyed.headers import HEADER_KEY
from celery_keyed.ledger import InvalidKey, normalize_key

#: Newest wins: the worker's gate (celery_keyed.gate, which imports this module) sets it while it runs: whether the
#: attempt (task id, retries) runs in this process and a newer arrival's cancel reached it (``keyed_cancelled``).
_cancel_probe: Callable[[str, int], bool] | None = None


def set_cancel_probe(probe: Callable[[str, int], bool] | None) -> None:
    """Install (the gate's start) or remove (its shutdown) the probe behind ``KeyedTask.keyed_cancelled``."""
    global _cancel_probe
    _cancel_probe = probe


class InTaskControls(Task):
    """The methods a running keyed task calls on itself (``self`` of a ``bind=True`` task)."""

    per_call_keys: bool  # KeyedTask's option

    def keyed_cancelled(self) -> bool:
        """Newest wins (``on_newer="cancel_running"``): whether a newer call of this task's key and supersede key asked
        this attempt to stop and the worker passed it on. Poll it in long loops on pools that cannot terminate a task
        (threads, gevent, eventlet, solo) and return early: the attempt is recorded ``superseded`` however it ends.
        On prefork the pool process is terminated instead, so this stays False there. False outside a worker."""
        probe = _cancel_probe
        task_id = getattr(self.request, "id", None)
        if probe is None or task_id is None:
            return False
        return probe(task_id, int(getattr(self.request, "retries", 0) or 0))

    def release_concurrency(self) -> bool:
        """Give back this attempt's concurrency slots now, from inside the task; the rest of the run is unkeyed
        (a group keeps its order: its head is still running). True when slots were given back; False when
        there were none (not keyed, already released, or not running under a worker's gate)."""
        from celery_keyed.access import dispatch, publisher_for
        from celery_keyed.ledger import Token

        fence = getattr(self.request, "keyed_fence", None)
        publisher = publisher_for(self.app)
        if fence is None or publisher is None or self.request.id is None:
            return False
        token = Token(self.request.id, int(self.request.retries or 0))
        released, promotions = publisher.ledger.release_early(token, fence)
        dispatch(self.app, promotions)
        return released

    def keyed_pause(self, seconds: float, *, reason: str | None = None, key: str | None = None) -> datetime:
        """Pause this task's own key — not its whole name — for ``seconds`` (e.g. on a 429, ``Retry-After``): no task
        of the key starts before then, cluster-wide; tasks of the key that run now go on (this one too); its waiting
        tasks keep their places and start when the pause ends (within one ``keyed_sweep_interval``). Other keys of
        the name are not affected. A pause is only ever extended (several tasks pausing at once: the latest end
        wins). ``key``: which of the task's keys, when it has several. Returns the end of the pause in force.
        Audited (``keyed_override_log``: the task's name and id as author)."""
        from celery_keyed.access import ledger_for

        until, _ = ledger_for(self.app).pause_key(
            self._keyed_own_key(key), seconds, reason=reason or f"paused by {self.name}", author=self._keyed_author()
        )
        return until

    def keyed_set_limit(
        self,
        limit: int,
        *,
        expires: float | datetime | None = None,
        reason: str | None = None,
        key: str | None = None,
    ) -> None:
        """Give this task's own key a limit of its own (it replaces the name's limit for this key only; 0 stops the
        key until the limit is cleared or expires), e.g. from a vendor's concurrency header, for ``expires`` seconds
        (or until a datetime; None: until cleared). Lowering never stops running tasks; raising starts waiting ones
        at once. Setting the limit the key has already, for the same reason, only moves its expiry (no new audit
        row). ``key``: which of the task's keys, when it has several."""
        from celery_keyed.access import dispatch, ledger_for

        promotions = ledger_for(self.app).set_key_limit(
            self._keyed_own_key(key), limit, reason=reason or f"set by {self.name}", author=self._keyed_author(),
            expires_in=None if isinstance(expires, datetime) else expires,
            expires_at=expires if isinstance(expires, datetime) else None,
        )
        dispatch(self.app, promotions)

    def _keyed_own_key(self, key: str | None) -> str:
        """The concurrency key of the running call (its header, else computed from its arguments as a worker does
        for ``send_task``): the one it has, or ``key`` when it is one of them; else :class:`InvalidKey`."""
        request = self.request
        keys = getattr(request, HEADER_KEY, None) if self.per_call_keys is True else None
        if keys is None:
            keys = evaluate_keys(key_spec(self, "concurrency_key"), self, tuple(request.args or ()),
                                 dict(request.kwargs or {}))
        own = [keys] if isinstance(keys, str) else [normalize_key(k) for k in keys or ()]
        if key is not None:
            key = normalize_key(key)
            if key not in own:
                raise InvalidKey(f"{self.name}: {key!r} is not a concurrency key of this call ({own!r})")
            return key
        if len(own) != 1:
            raise InvalidKey(
                f"{self.name}: this call has {'no concurrency key' if not own else f'several keys {own!r}'}: "
                "name the one to throttle with key="
            )
        return own[0]

    def _keyed_author(self) -> str:
        return f"task {self.name}[{getattr(self.request, 'id', None)}]"
