"""The line of requests waiting for a pool process: kombu's ``LaxBoundedSemaphore._waiting`` of the consumer's pool
(prefork), and the place a keyed request takes in it (``join_line``: those that hold a slot go first, oldest
first). Consumer loop thread only. No state of its own; imports no service.
"""

from __future__ import annotations

from collections import deque
from typing import Any


def pool_line(consumer: Any) -> deque[Any] | None:
    """The line of requests waiting for a pool process: kombu's ``LaxBoundedSemaphore._waiting`` of the consumer's
    pool (prefork), entries ``(callback, args, kwargs)`` with the request first in ``args``; None without one."""
    semaphore = getattr(getattr(consumer, "controller", None), "semaphore", None)
    waiting = getattr(semaphore, "_waiting", None)
    return waiting if isinstance(waiting, deque) else None


def _line_request(entry: Any) -> Any:
    return entry[1][0] if isinstance(entry, tuple) and len(entry) == 3 and entry[1] else None


def slot_holders_ahead(waiting: deque[Any]) -> int:
    """How many requests at the front of the line already hold a slot (``join_line``)."""
    count = 0
    for entry in waiting:
        if not getattr(_line_request(entry), "keyed_slot_held", False):
            break
        count += 1
    return count


def join_line(consumer: Any, request: Any, *, behind: int | None = None) -> None:
    """Loop thread: ``request`` has just been handed to Celery's ``on_task_request``; if it waits for a pool process
    (the last in the line), give it its place. The requests that hold a slot (``keyed_slot_held``: promotions started
    here, claims taken ahead) go first, in the order they joined: each keeps its key's line waiting until it starts,
    while a request that holds nothing keeps nobody waiting. Among them the oldest goes first: the newest first kept a
    key whose release had just bound its next attempt here running on the process that freed, release after release,
    while the other keys' promotions and claims taken ahead waited (peers W4: the last keys ran alone at the end).
    A request that holds nothing stays last, or goes ``behind`` that many places after those that do
    (``GateService._back_in_line``)."""
    waiting = pool_line(consumer)
    if waiting is None or len(waiting) < 2 or _line_request(waiting[-1]) is not request:
        return
    held = getattr(request, "keyed_slot_held", False)
    if not held and behind is None:
        return
    entry = waiting.pop()
    holders = slot_holders_ahead(waiting)
    waiting.insert(holders if held else min(holders + (behind or 0), len(waiting)), entry)
