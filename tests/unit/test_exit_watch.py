"""The exit watch (celery_keyed/worker/exits.py): a release held for a pool process runs once that process has exited
— a real child process here, stopped by a signal, as a hard time limit's SIGKILL does — and never before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

from celery_keyed.worker.exits import ExitWatch, has_exited


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _wait(condition, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_release_waits_for_the_process_and_runs_once_it_has_exited() -> None:
    child = _child()
    released: list[int] = []
    try:
        watch = ExitWatch(lambda: [], interval=0.01)
        assert watch.hold(child.pid, lambda: released.append(1))
        assert watch.hold(child.pid, lambda: released.append(2))  # a second release for the same process
        time.sleep(0.2)
        assert released == [] and watch.waiting() == 1  # it still runs
        os.kill(child.pid, signal.SIGKILL)
        _wait(lambda: released == [1, 2])  # the zombie (not reaped yet) has exited: both run, in order
        assert watch.waiting() == 0
    finally:
        child.kill()
        child.wait()


def test_a_reaped_process_counts_as_exited_through_billiards_popen() -> None:
    child = _child()
    child.kill()
    child.wait()  # reaped
    assert has_exited(child.pid, SimpleNamespace(_popen=SimpleNamespace(returncode=-9)))
    assert has_exited(child.pid, None)  # no such process any more


def test_nothing_to_wait_for_is_not_held() -> None:
    watch = ExitWatch(lambda: [])
    ran: list[int] = []
    assert not watch.hold(None, lambda: ran.append(1))  # never accepted by a pool process
    assert not watch.hold(os.getpid(), lambda: ran.append(1))  # the solo / threads pools: the body ran here
    child = _child()
    child.kill()
    child.wait()
    assert not watch.hold(child.pid, lambda: ran.append(1))  # exited already
    assert ran == []  # the caller releases itself
    assert watch.watch_once().released == 0


def test_a_running_process_of_the_pool_is_watched_through_its_popen() -> None:
    child = _child()
    try:
        popen = SimpleNamespace(returncode=None)
        process = SimpleNamespace(pid=child.pid, _popen=popen)
        watch = ExitWatch(lambda: [process])
        released: list[int] = []
        assert watch.hold(child.pid, lambda: released.append(1))
        assert watch.watch_once().waiting == 1 and released == []
        popen.returncode = -15  # billiard reaped it
        report = watch.watch_once()
        assert (report.released, report.waiting, released) == (1, 0, [1])
    finally:
        child.kill()
        child.wait()
