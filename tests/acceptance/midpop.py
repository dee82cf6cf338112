"""A worker killed between its broker pop and the record of the delivery (issue 14 item 8): kombu's Redis transport
takes a message off the queue's list (BRPOP) and only then records it in the ``unacked`` hash; a worker killed in
between loses the message for the broker — no queue and no visibility timeout holds it any more.

``KEYED_TEST_DIE_AFTER_POP=<prefix>`` makes the acceptance app's worker process exit at once (``os._exit``, as a
SIGKILL would end it: no cleanup, no ack, no reject) when it has popped a message whose task id starts with
``<prefix>``, before kombu delivers it."""

from __future__ import annotations

import os
from typing import Any


def die_after_pop(prefix: str) -> None:
    from kombu.transport.virtual.base import Transport

    deliver = Transport._deliver

    def _deliver(self: Any, message: Any, queue: str) -> Any:
        headers = (message or {}).get("headers") or {}
        if str(headers.get("id", "")).startswith(prefix):
            os._exit(9)  # popped from the list, not in the unacked hash yet
        return deliver(self, message, queue)

    Transport._deliver = _deliver
