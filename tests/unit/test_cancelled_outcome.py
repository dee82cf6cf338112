"""What a cancelled attempt is booked as (celery_keyed/request.py): Celery cancels the running tasks in a cold shutdown
and on a lost connection; the outcome follows whether the message comes back."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from billiard.einfo import ExceptionInfo
from celery.exceptions import Terminated, TimeLimitExceeded

from celery_keyed.ledger import Outcome
from celery_keyed.request import cancelled_for_good, failure_outcome, is_hard_time_limit, release_stopped


def _info(exc: BaseException) -> Any:
    try:
        raise exc
    except BaseException:
        return ExceptionInfo()


def _request(*, acks_late: bool, acknowledged: bool, cancelled: bool = True) -> Any:
    task = SimpleNamespace(acks_late=acks_late, reject_on_worker_lost=True, acks_on_timeout=True)
    return SimpleNamespace(task=task, acknowledged=acknowledged, _already_cancelled=cancelled)


def test_a_cancelled_acks_late_task_comes_back_as_worker_lost() -> None:
    request = _request(acks_late=True, acknowledged=False)
    for exc in (Terminated(15), SystemExit(1)):
        assert failure_outcome(request, _info(exc)) is Outcome.WORKER_LOST
        assert not cancelled_for_good(request, _info(exc))


def test_a_cancelled_task_acked_at_start_is_failed_for_good() -> None:
    request = _request(acks_late=False, acknowledged=True)
    for exc in (Terminated(15), SystemExit(1)):
        assert failure_outcome(request, _info(exc)) is Outcome.FAILED
        assert cancelled_for_good(request, _info(exc))


def test_a_terminate_that_was_no_cancel_is_a_revoke() -> None:
    request = _request(acks_late=False, acknowledged=True, cancelled=False)
    assert failure_outcome(request, _info(Terminated(15))) is Outcome.REVOKED
    assert not cancelled_for_good(request, _info(Terminated(15)))


def test_a_body_that_failed_on_its_own_after_a_cancel_keeps_its_failure() -> None:
    request = _request(acks_late=False, acknowledged=True)
    assert failure_outcome(request, _info(RuntimeError("cleanup failed"))) is Outcome.FAILED
    assert not cancelled_for_good(request, _info(RuntimeError("cleanup failed")))  # Celery stored its own failure


def test_only_a_hard_time_limit_waits_for_the_process() -> None:
    assert is_hard_time_limit(_info(TimeLimitExceeded(2.0)))
    assert not is_hard_time_limit(_info(Terminated(15)))


class _Backend:
    def __init__(self, status: str) -> None:
        self.status = status
        self.stored: list[BaseException] = []

    def get_task_meta(self, task_id: str, cache: bool = True) -> dict[str, Any]:
        return {"status": self.status}

    def mark_as_failure(self, task_id: str, exc: BaseException, **_: Any) -> None:
        self.stored.append(exc)
        self.status = "FAILURE"


class _Gate:
    def __init__(self) -> None:
        self.released: list[Outcome] = []

    def release(self, request: Any, outcome: Outcome, **_: Any) -> None:
        self.released.append(outcome)


def _limited(status: str) -> tuple[Any, _Backend]:
    backend = _Backend(status)
    task = SimpleNamespace(backend=backend, ignore_result=False)
    request = SimpleNamespace(task=task, id="t1", name="t", time_limits=(0.5, None), _context=None, store_errors=True)
    return request, backend


def test_a_hard_time_limit_booked_failed_stores_its_failure_when_celery_stored_none() -> None:
    # A cold shutdown that came with the limit kept Celery from storing it: the books say failed, so must the result.
    request, backend = _limited("PENDING")
    gate = _Gate()
    release_stopped(gate, request, Outcome.FAILED)
    assert gate.released == [Outcome.FAILED]
    assert [type(e) for e in backend.stored] == [TimeLimitExceeded]


def test_a_hard_time_limit_whose_failure_celery_stored_stores_nothing_more() -> None:
    request, backend = _limited("FAILURE")
    gate = _Gate()
    release_stopped(gate, request, Outcome.FAILED)
    assert gate.released == [Outcome.FAILED] and backend.stored == []


def test_a_body_that_ran_to_its_end_after_its_hard_time_limit_is_completed() -> None:
    request, backend = _limited("SUCCESS")
    gate = _Gate()
    release_stopped(gate, request, Outcome.FAILED)
    assert gate.released == [Outcome.COMPLETED] and backend.stored == []
