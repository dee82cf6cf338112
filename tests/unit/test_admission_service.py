"""The admission service's own rules (celery_keyed/worker/admission.py): batches in hand-over order, a batch at
most ``batch`` long, start/stop safe twice, nothing handed over is lost at stop, a failing ``decide`` fails its
batch's jobs instead of the thread. The ledger side of a batch is tested in tests/integration/test_batches.py,
the worker side with real workers in tests/acceptance/test_admission_off_the_loop.py."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from celery_keyed.worker.admission import AdmissionService, Job


def job(n: int) -> Job:
    return Job(request=n, arrival=n, submit=lambda: None)


class Recorder:
    def __init__(self, *, block: threading.Event | None = None, fail: bool = False) -> None:
        self.decided: list[list[int]] = []
        self.delivered: list[list[int]] = []
        self.block = block
        self.fail = fail
        self.done = threading.Event()

    def decide(self, jobs: Sequence[Job]) -> None:
        if self.block is not None:
            self.block.wait(10)
        if self.fail:
            raise RuntimeError("decide broke")
        self.decided.append([j.request for j in jobs])
        for j in jobs:
            j.result = ("ok", j.request)

    def deliver(self, jobs: list[Job]) -> None:
        self.delivered.append([j.request for j in jobs])
        self.done.set()


def test_admit_once_decides_in_hand_over_order_in_batches_of_at_most_batch() -> None:
    rec = Recorder()
    service = AdmissionService(rec.decide, rec.deliver, batch=3)
    service._accepting = True  # as start() does, without the thread: admit_once is called by the test
    for n in range(7):
        assert service.submit(job(n))
    while service.admit_once():
        pass
    assert rec.decided == [[0, 1, 2], [3, 4, 5], [6]]
    assert rec.delivered == rec.decided


def test_the_thread_batches_what_arrived_while_it_was_busy() -> None:
    release = threading.Event()
    rec = Recorder(block=release)
    service = AdmissionService(rec.decide, rec.deliver, batch=64)
    service.start()
    try:
        service.submit(job(0))
        # job 0 is being decided (blocked); 1..5 arrive meanwhile and are decided together after it
        for n in range(1, 6):
            service.submit(job(n))
        release.set()
        deadline = threading.Event()
        for _ in range(200):
            if sum(len(b) for b in rec.delivered) == 6:
                break
            deadline.wait(0.02)
    finally:
        service.stop()
    assert [n for batch in rec.delivered for n in batch] == list(range(6))
    assert len(rec.delivered) <= 3  # not one call per job


def test_start_and_stop_twice_and_nothing_handed_over_is_lost_at_stop() -> None:
    release = threading.Event()
    rec = Recorder(block=release)
    service = AdmissionService(rec.decide, rec.deliver, batch=2)
    service.start()
    service.start()
    for n in range(5):
        service.submit(job(n))
    release.set()
    service.stop()
    service.stop()
    assert [n for batch in rec.delivered for n in batch] == list(range(5))
    assert not service.submit(job(99)), "a stopped service must refuse new work (the gate admits on the loop)"
    assert service.pending() == 0
    service.start()  # a consumer restart (broker reconnect) starts it again
    assert service.submit(job(7))
    service.stop()
    assert rec.delivered[-1] == [7]


def test_a_failing_decide_fails_its_jobs_not_the_thread() -> None:
    rec = Recorder(fail=True)
    delivered: list[Job] = []

    def deliver(jobs: list[Job]) -> None:
        delivered.extend(jobs)

    service = AdmissionService(rec.decide, deliver, batch=8)
    service._accepting = True
    service.submit(job(1))
    service.submit(job(2))
    assert service.admit_once() == 2
    assert [j.request for j in delivered] == [1, 2]
    assert all(isinstance(j.error, RuntimeError) and j.result is None for j in delivered)


@pytest.mark.parametrize("batch", [0, -5])
def test_a_batch_below_one_still_decides_one_at_a_time(batch: int) -> None:
    rec = Recorder()
    service = AdmissionService(rec.decide, rec.deliver, batch=batch)
    service._accepting = True
    service.submit(job(1))
    service.submit(job(2))
    while service.admit_once():
        pass
    assert rec.decided == [[1], [2]]


class ReceiptLedger:
    """Records how the gate asks the ledger to park what was handed over at receipt."""

    def __init__(self, answers: list[object]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, int]] = []

    def park_many_at_receipt(self, arrivals: list[object]) -> list[object]:
        self.calls.append(("many", len(arrivals)))
        if isinstance(self.answers, BaseException):
            raise self.answers
        return self.answers

    def park_at_receipt(self, arrival: object) -> object:
        self.calls.append(("one", 1))
        return self.answers[0]


def receipt_jobs(n: int) -> list[Job]:
    return [Job(request=f"r{i}", arrival=f"a{i}", submit=lambda: None, extra={"receipt": True}) for i in range(n)]


def test_the_receipt_service_parks_a_batch_in_one_ledger_call() -> None:
    from types import SimpleNamespace

    from celery_keyed.worker.decide import Decide

    boom = RuntimeError("refused")
    ledger = ReceiptLedger(["parked", None, boom])
    jobs = receipt_jobs(3)
    Decide._park_received(SimpleNamespace(ledger=ledger), jobs)  # type: ignore[arg-type]
    assert ledger.calls == [("many", 3)]
    assert [j.result for j in jobs[:2]] == [(None, "parked"), (None, None)]
    assert jobs[2].result is None and jobs[2].error is boom  # its own call's error: admission at pool-ready decides

    single = ReceiptLedger(["parked"])
    one = receipt_jobs(1)
    Decide._park_received(SimpleNamespace(ledger=single), one)  # type: ignore[arg-type]
    assert single.calls == [("one", 1)] and one[0].result == (None, "parked")


def test_an_unreachable_ledger_fails_every_job_of_the_receipt_batch() -> None:
    from types import SimpleNamespace

    from celery_keyed.worker.decide import Decide

    down = ConnectionError("down")
    ledger = ReceiptLedger(down)  # type: ignore[arg-type]
    jobs = receipt_jobs(2)
    Decide._park_received(SimpleNamespace(ledger=ledger), jobs)  # type: ignore[arg-type]
    assert all(j.error is down and j.result is None for j in jobs)


def test_the_thread_decides_inside_its_thread_context_for_its_whole_life() -> None:
    """The gate passes ``Ledger.pinned``: the thread keeps one ledger connection from start to stop."""
    import contextlib

    events: list[tuple[str, str]] = []
    rec = Recorder()

    @contextlib.contextmanager
    def context():  # type: ignore[no-untyped-def]
        events.append(("enter", threading.current_thread().name))
        yield
        events.append(("exit", threading.current_thread().name))

    def decide(jobs: Sequence[Job]) -> None:
        events.append(("decide", threading.current_thread().name))
        rec.decide(jobs)

    service = AdmissionService(decide, rec.deliver, batch=4, name="keyed-admission-test", thread_context=context)
    service.start()
    try:
        service.submit(job(0))
        assert rec.done.wait(10)
        service.submit(job(1))
    finally:
        service.stop()
    thread_events = [what for what, name in events if name == "keyed-admission-test"]
    assert thread_events[0] == "enter" and thread_events[-1] == "exit"
    assert thread_events.count("enter") == 1 and "decide" in thread_events[1:-1]


def test_the_thread_warms_up_once_when_asked_and_idle_and_never_unasked() -> None:
    """``request_warm`` (the gate's first keyed arrival): the thread runs ``warm`` once, when it has nothing to
    decide, and so does the thread of a later start; never asked (a worker of plain tasks only), it never runs."""
    import time

    rec = Recorder()
    calls: list[str] = []

    def warm() -> None:
        calls.append("warm")

    def decide(jobs: Sequence[Job]) -> None:
        calls.append("decide")
        rec.decide(jobs)

    def wait_for(count: int) -> None:
        deadline = time.monotonic() + 10
        while calls.count("warm") < count and time.monotonic() < deadline:
            time.sleep(0.01)

    service = AdmissionService(decide, rec.deliver, batch=4, warm=warm)
    service.start()
    try:
        service.submit(job(0))
        assert rec.done.wait(10)
        time.sleep(0.05)
        assert calls == ["decide"]  # not asked: no warm-up
        service.request_warm()
        service.request_warm()  # asked twice: once
        wait_for(1)
        rec.done.clear()
        service.submit(job(1))
        assert rec.done.wait(10)
    finally:
        service.stop()
    assert calls == ["decide", "warm", "decide"]
    service.start()  # a consumer restart: a new thread, a new connection, warmed up again once idle
    try:
        rec.done.clear()
        service.submit(job(2))
        assert rec.done.wait(10)
        wait_for(2)
    finally:
        service.stop()
    assert calls.count("warm") == 2 and calls.count("decide") == 3
    assert calls[:3] == ["decide", "warm", "decide"]


def test_jobs_that_may_wait_are_decided_together_once_their_time_comes_or_enough_of_them_are_queued() -> None:
    """``AdmissionService.lingering``: while every queued job may wait (``extra["by"]``: a claim taken ahead of a
    pool process) and fewer than ``LINGER_BATCH`` are queued, the thread waits until the earliest ``by``; a job
    that may not wait (a park, a request handed on in order) or a full batch ends the wait. The thread decides the
    jobs that may wait together, once."""
    import time

    from celery_keyed.worker.admission import LINGER_BATCH

    rec = Recorder()
    service = AdmissionService(rec.decide, rec.deliver, batch=64)
    now = 100.0
    early, late = job(1), job(2)
    early.extra["by"], late.extra["by"] = now + 0.004, now + 0.009
    assert service.lingering(now) == 0.0  # nothing queued
    service._accepting = True
    service.submit(late)
    service.submit(early)
    assert service.lingering(now) == pytest.approx(0.004)
    assert service.lingering(now + 0.01) == 0.0  # its time has come
    service.submit(job(3))  # may not wait
    assert service.lingering(now) == 0.0
    full = AdmissionService(rec.decide, rec.deliver, batch=64)
    full._accepting = True
    for n in range(LINGER_BATCH):
        waiting = job(n)
        waiting.extra["by"] = now + 1
        full.submit(waiting)
    assert full.lingering(now) == 0.0

    # The thread: three jobs that may wait 50 ms are decided in one batch, after the first one's time.
    rec = Recorder()
    service = AdmissionService(rec.decide, rec.deliver, batch=64)
    service.start()
    try:
        handed = time.monotonic()
        for n in range(3):
            waiting = job(n)
            waiting.extra["by"] = handed + 0.05
            service.submit(waiting)
        assert rec.done.wait(10)
        assert rec.decided == [[0, 1, 2]]
        assert time.monotonic() - handed >= 0.04
    finally:
        service.stop()


def test_jobs_that_may_wait_handed_over_during_a_batch_wait_for_the_next_look_and_go_together() -> None:
    """The thread decides one batch per look: jobs that may wait (``extra["by"]``), handed over while a batch is
    being decided, are not decided the moment it ends (a batch of one or two each, as under load they came) but at
    the next look, which lingers until their time, together."""
    import time

    release, entered = threading.Event(), threading.Event()
    rec = Recorder(block=release)

    def decide(jobs: Sequence[Job]) -> None:
        entered.set()
        rec.decide(jobs)

    service = AdmissionService(decide, rec.deliver, batch=64)
    service.start()
    try:
        service.submit(job(0))  # may not wait: decided at once (blocked in decide)
        assert entered.wait(10)
        handed = time.monotonic()
        for n in (1, 2, 3):
            waiting = job(n)
            waiting.extra["by"] = handed + 0.3
            service.submit(waiting)
        release.set()
        deadline = time.monotonic() + 10
        while sum(len(b) for b in rec.delivered) < 4:
            assert time.monotonic() < deadline, "the thread kept its jobs"
            time.sleep(0.005)
        decided_at = time.monotonic()
    finally:
        service.stop()
    assert rec.decided == [[0], [1, 2, 3]]
    assert decided_at - handed >= 0.25  # they waited for their time at the next look


def test_no_job_is_left_behind_by_a_thread_that_is_woken_only_when_it_must_be() -> None:
    """Jobs submitted from two threads as fast as they can, some that may wait a moment and some that may not: every
    one is decided and delivered, in order per submitting thread (a job that did not wake a lingering thread and was
    then left in the queue with the thread asleep would fail the wait)."""
    import time

    rec = Recorder()
    service = AdmissionService(rec.decide, rec.deliver, batch=5)
    service.start()
    try:
        def many(base: int) -> None:
            for n in range(base, base + 1500):
                submitted = job(n)
                if n % 3:
                    submitted.extra["by"] = time.monotonic() + 0.001
                assert service.submit(submitted)

        other = threading.Thread(target=many, args=(10_000,))
        other.start()
        many(0)
        other.join()
        deadline = time.monotonic() + 20
        while sum(len(batch) for batch in rec.delivered) < 3000:
            assert time.monotonic() < deadline, "jobs were left in the queue"
            time.sleep(0.01)
    finally:
        service.stop()
    delivered = [n for batch in rec.delivered for n in batch]
    assert sorted(delivered) == list(range(1500)) + list(range(10_000, 11_500))
    for low in (0, 10_000):
        mine = [n for n in delivered if low <= n < low + 1500]
        assert mine == sorted(mine)


def test_a_lingering_thread_is_woken_only_by_a_job_that_ends_its_wait() -> None:
    """While the thread waits for jobs that may wait (``extra["by"]``), a job that would not end that wait leaves it
    asleep; one that may wait less, or may not wait at all, wakes it, and they are decided together."""
    import time

    class CountingEvent(threading.Event):
        sets = 0

        def set(self) -> None:
            self.sets += 1
            super().set()

    rec = Recorder()
    service = AdmissionService(rec.decide, rec.deliver, batch=64)
    ready = service._ready = CountingEvent()
    service.start()
    try:
        handed = time.monotonic()
        first = job(0)
        first.extra["by"] = handed + 30
        service.submit(first)  # wakes the idle thread, which then lingers until its time
        deadline = time.monotonic() + 10
        while service._linger_until is None:
            assert time.monotonic() < deadline, "the thread did not linger"
            time.sleep(0.005)
        woken = ready.sets
        for n in (1, 2):
            later = job(n)
            later.extra["by"] = handed + 31
            service.submit(later)
        assert ready.sets == woken  # none of them ends the wait
        sooner = job(3)
        sooner.extra["by"] = handed + 0.05
        service.submit(sooner)
        assert ready.sets == woken + 1
        assert rec.done.wait(10)
        assert rec.decided == [[0, 1, 2, 3]]
        assert time.monotonic() - handed < 10  # at the sooner job's time, not the first one's
    finally:
        service.stop()
