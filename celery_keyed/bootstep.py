"""``KeyedGate``: the consumer bootstep that owns the gate service (its ledger pool and the services of
celery_keyed/worker/: admission, releaser, heartbeat, sweeper, handoff, breaker, revokes).

Like Celery's own consumer steps it is a thin start/stop wrapper; it restarts with the consumer on every
broker reconnect, and ``stop``/``shutdown`` are safe to call twice. It also makes Celery's ``revoke`` remote
control command store the revoke in the ledger (``wrap_revoke_commands``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

from celery import bootsteps, signals
from celery.utils.functional import maybe_list
from celery.worker.control import Panel, control_command, inspect_command

from celery_keyed.gate import GateService, current_gate
from celery_keyed.settings import read_settings
from celery_keyed.task import KeyedTask
from celery_keyed.worker import intake

logger = logging.getLogger("celery_keyed")

#: Celery's remote control commands that revoke by task id (``app.control.revoke``, ``celery control
#: terminate``); ``revoke_by_stamped_headers`` names no task id and is left alone.
REVOKE_COMMANDS = ("revoke", "terminate")


class KeyedGate(bootsteps.StartStopStep):
    """Admit or park every keyed message this worker consumes."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "KeyedGate"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.gate: GateService | None = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        wrap_revoke_commands()
        # Every task's strategy (Celery rebuilt them on this consumer start, in the same dict its task handler reads):
        # a message Celery's own strategy cannot take is rejected as invalid instead of killing the worker.
        for name, strategy in list(c.strategies.items()):
            task = c.app.tasks.get(name)
            c.strategies[name] = intake.guarded(strategy, self._refuser(task) if isinstance(task, KeyedTask) else None)
        if self.gate is None:
            self.gate = GateService(c.app, c, read_settings(c.app.conf))
        self.gate.consumer = c
        self.gate.start()

    def _refuser(self, task: Any) -> Callable[[str | None, str], None]:
        """For a keyed task: a message refused as malformed ends like any keyed message that never runs: recorded as
        rejected in the books, with a ``KeyedRejected`` result (when it has a task id to keep them under)."""

        def refuse(task_id: str | None, detail: str) -> None:
            gate = self.gate
            if gate is None or task_id is None:
                logger.error("celery-keyed: %s: %s (no task id to record it under)", task.name, detail)
                return
            gate.refuse_malformed(task_id, task.name, detail, task)

        return refuse

    def stop(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.stop()

    def shutdown(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.shutdown()
            controller = getattr(c, "controller", None)  # Celery's WorkController: worker_shutdown's sender
            if controller is not None:  # for the give-back once its pool has stopped
                _stopped_gates.setdefault(controller, []).append(self.gate)
            self.gate = None


#: Per worker (Celery's WorkController), its gates shut down, whose unstarted claims go back at ``worker_shutdown``.
_stopped_gates: weakref.WeakKeyDictionary[Any, list[GateService]] = weakref.WeakKeyDictionary()


@signals.worker_shutdown.connect
def _release_unstarted(sender: Any = None, **kwargs: Any) -> None:
    """Celery sends ``worker_shutdown`` after a warm shutdown has stopped and joined the pool (and at once when it
    could not stop it from a signal handler: then the pool may still start work, and nothing is released here)."""
    pool = getattr(sender, "pool", None)
    if sender is None or (pool is not None and getattr(pool, "active", False)):
        return
    for gate in _stopped_gates.pop(sender, []):
        try:
            gate.release_unstarted("the worker stopped its pool before a process took it")
        except Exception:
            logger.exception("celery-keyed: could not release the claims of requests that never started")


def wrap_revoke_commands() -> None:
    """Make Celery's revoke commands also store the revoke in the ledger: a parked task's message lives in
    Postgres, not in any worker's memory, so Celery's in-memory revoke list alone never reaches it (D11).

    The worker's mailbox dispatches to the handlers of Celery's global ``Panel`` (the same dict object), so the
    handlers are wrapped there, once per process. The wrapper asks for this process's gate at call time:
    without one (a worker without ``install(app)``, or after shutdown) Celery's handler runs unchanged. The
    ledger is written first, then Celery's handler runs as usual."""
    for name in REVOKE_COMMANDS:
        handler = Panel.data.get(name)
        if handler is not None and not getattr(handler, "keyed_records_revokes", False):
            Panel.data[name] = _recording_revokes(handler)


def _recording_revokes(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    def keyed_revoke_command(state: Any, *args: Any, **kwargs: Any) -> Any:
        gate = current_gate()
        task_ids = maybe_list(kwargs.get("task_id")) or []
        if gate is not None and task_ids:
            try:
                gate.record_revokes(task_ids)
            except Exception:
                logger.exception("celery-keyed: could not store the revoke of %s in the ledger", task_ids)
        return handler(state, *args, **kwargs)

    keyed_revoke_command.keyed_records_revokes = True  # type: ignore[attr-defined]
    return keyed_revoke_command


@inspect_command(name="keyed_inspect")
def keyed_inspect(state: Any, **kwargs: Any) -> dict[str, Any]:
    """Remote control command behind ``celery keyed inspect``: what this worker's gate holds now."""
    gate = current_gate()
    if gate is None:
        return {"error": "no celery-keyed gate in this worker (install(app) not called, or shutting down)"}
    return gate.snapshot()


@control_command(
    name="keyed_cancel",
    args=[("claims", list)],
    signature="<[[task_id, attempt, holder], ...]>",
)
def keyed_cancel(state: Any, claims: list[Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Remote control command behind newest wins (``on_newer="cancel_running"``): a newer arrival asked the attempts
    listed (task id, attempt, holder) to stop. The worker whose gate holds one checks the request in the ledger (the
    authority: a stale or forged broadcast cancels nothing) and passes it on (``GateService.check_cancels``)."""
    gate = current_gate()
    if gate is None or not claims:
        return {"ok": "nothing here"}
    try:
        wanted = [(str(c[0]), int(c[1]), c[2]) for c in claims if isinstance(c, list | tuple) and len(c) == 3]
        gate.check_cancels(wanted)
    except Exception:
        logger.exception("celery-keyed: could not pass on a keyed_cancel request")
    return {"ok": "checked"}
