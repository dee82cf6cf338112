"""``observed(task, key, label)``: record an attempt's start and end (or failure) in ``Observation``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from example_project.shop.models import Observation


def _record(kind: str, task: Any, key: str, label: str) -> None:
    request = task.request
    Observation.objects.create(
        kind=kind,
        task_id=str(request.id),
        attempt=int(request.retries or 0),
        key=key,
        label=label,
        worker=str(request.hostname or ""),
        pid=os.getpid(),
    )


@contextmanager
def observed(task: Any, key: str, label: str) -> Iterator[None]:
    """Around a task's body: a ``start`` row, then ``end``, or ``fail`` when it raised (a retry included)."""
    _record("start", task, key, label)
    try:
        yield
    except BaseException:
        _record("fail", task, key, label)
        raise
    _record("end", task, key, label)
