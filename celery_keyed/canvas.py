"""Keyed tasks inside Celery's canvas (chain, group, chord): a member the gate turns away never leaves its chord
waiting for ever, nor the rest of its chain unsent and unanswered (docs/canvas.md has the behaviour per outcome).

Members that reach a worker and never run (rejected, expired, superseded, debounced away, revoked while waiting) get
their ``Keyed…`` failure stored with their message's request context (``messages.context_from_record``), through
Celery's own ``backend.mark_as_failure``: the chord's part is counted (the body runs or gets its ``ChordError``), the
rest of the chain is marked failed, the errbacks are called — as for a member whose body raised. The message of a
parked member that never runs is kept in the books until then (``keyed_tasks.message``).

A member refused at send (``admit_at_send``) never reaches a broker: this module stores its ``KeyedRejected``
failure the same way, from the send's options, and the send answers the member's result instead of raising in the
middle of a canvas (``refuse_member``). Outside a canvas the send raises, as documented for ``admit_at_send``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery_keyed.exceptions import KeyedRejected

logger = logging.getLogger("celery_keyed")

#: Send options that make a call a member of a canvas: the rest of its chain, its chord, its group, or a parent that
#: sent it as a chain step or a callback (Celery's worker passes ``parent_id`` to those sends).
CANVAS_OPTIONS = ("chain", "chord", "group_id", "parent_id")


def member_of_canvas(options: Mapping[str, Any]) -> bool:
    """Whether a send with these options belongs to a chain, a group or a chord (or is a callback)."""
    return "chain" in options or any(options.get(name) for name in CANVAS_OPTIONS)


def send_context(task_id: str, task_name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The request context a worker would have built from the message this send would have published: enough for
    ``backend.mark_as_failure`` to count a chord's part, fail the rest of a chain and call the errbacks."""
    return {
        "id": task_id,
        "task": task_name,
        "group": options.get("group_id"),
        "group_index": options.get("group_index"),
        "chord": options.get("chord"),
        "chain": options.get("chain"),
        "callbacks": options.get("link"),
        "errbacks": options.get("link_error"),
        "root_id": options.get("root_id"),
        "parent_id": options.get("parent_id"),
        "reply_to": options.get("reply_to"),
        "correlation_id": task_id,
        "delivery_info": {},  # Celery's errback call reads it (a worker's request always has one)
    }


def refuse_member(task: Any, task_id: str, options: Mapping[str, Any], refused: Exception) -> Any:
    """A canvas member refused at send: store ``refused`` (a ``KeyedRejected``) as its result with its canvas
    context, so the chord, the chain and the errbacks go on as for a member that failed; answer its result. Raises
    ``refused`` when the result cannot be stored (the caller then knows, as outside a canvas)."""
    from celery.app.task import Context

    context = send_context(task_id, task.name, options)
    # A plain KeyedRejected: the result backend rebuilds an exception from its message alone.
    stored = KeyedRejected(str(refused))
    try:
        task.backend.mark_as_failure(task_id, stored, request=Context(context), store_result=True)
    except Exception:
        logger.exception("celery-keyed: could not store the refusal of %s[%s]", task.name, task_id)
        raise refused from None
    logger.warning("celery-keyed: %s[%s] refused at send, stored as its result: %s", task.name, task_id, refused)
    return task.AsyncResult(task_id)
