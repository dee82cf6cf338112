"""``KeyedGate``: the consumer bootstep that owns the gate service (ledger pool, heartbeat, sweeper, breaker).

Like Celery's own consumer steps it is a thin start/stop wrapper; it restarts with the consumer on every
broker reconnect, and ``stop``/``shutdown`` are safe to call twice.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps

from celery_keyed.gate import GateService
from celery_keyed.settings import read_settings


class KeyedGate(bootsteps.StartStopStep):
    """Admit or park every keyed message this worker consumes."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    label = "KeyedGate"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.gate: GateService | None = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        if self.gate is None:
            self.gate = GateService(c.app, c, read_settings(c.app.conf))
        self.gate.consumer = c
        self.gate.start()

    def stop(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.stop()

    def shutdown(self, c: Any) -> None:
        if self.gate is not None:
            self.gate.shutdown()
            self.gate = None
