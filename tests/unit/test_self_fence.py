"""The self-fence (D19) driven directly, with a stand-in gate and ledger (no database, no worker): its deadline is
kept by a timer of its own, counted from when the last successful renewal was *sent*, and every failure counts —
an ``InterfaceError`` and a pool checkout ``TimeoutError`` as much as an ``OperationalError``."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.gate import Running
from celery_keyed.ledger import HeldClaim, Token
from celery_keyed.worker.fence import SelfFence
from celery_keyed.worker.heartbeat import Heartbeat

LEASE, MARGIN, INTERVAL = 6.0, 1.0, 1.0


class FakeLedger:
    """Renews what it is asked to, after ``delay`` seconds, or raises ``fail``."""

    def __init__(self) -> None:
        self.fail: BaseException | None = None
        self.delay = 0.0
        self.called_at: list[float] = []

    def renew(self, held: list[HeldClaim]) -> set[HeldClaim]:
        self.called_at.append(time.monotonic())
        if self.delay:
            time.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return set(held)

    def ping(self) -> None:
        if self.fail is not None:
            raise self.fail

    def record_pids(self, pids: list[int]) -> None:
        pass


def _gate(ledger: FakeLedger) -> Any:
    opened: list[BaseException] = []
    gate = SimpleNamespace(
        settings=SimpleNamespace(
            lease=LEASE, self_fence_margin=MARGIN, heartbeat_interval=INTERVAL, self_fence=True, sweep_interval=60.0
        ),
        lock=threading.Lock(),
        running={},
        ledger=ledger,
        consumer=SimpleNamespace(pool=None),
        handoff=SimpleNamespace(prebound={}, give_back_prebound=lambda *a, **k: None),
        breaker=SimpleNamespace(open=opened.append, close=lambda: None, is_open=False),
        releaser=SimpleNamespace(flush_pending=lambda: None, pending=[]),
        revokes=SimpleNamespace(flush_pending=lambda: None),
        check_cancels=lambda: None,
        closed=True,  # no never-started check
        stopping=threading.Event(),
        started_at=0.0,
        opened=opened,
    )
    return gate


def heartbeat_of(gate: Any) -> Any:
    """A heartbeat whose collaborators are the fake gate's."""
    fields = ("settings", "consumer", "ledger", "lock", "running", "handoff", "releaser", "breaker", "revokes")
    heartbeat = Heartbeat(**{name: getattr(gate, name, None) for name in fields}, life=gate)
    heartbeat.check_cancels = getattr(gate, "check_cancels", lambda: None)
    return heartbeat


def _track(gate: Any, task_id: str, *, pid: int | None = None, lease_from: float | None = None) -> Running:
    token = Token(task_id, 0)
    request = SimpleNamespace(name="t", keyed_claim=(token, 1), keyed_started=True, worker_pid=pid, keyed_fenced=None)
    entry = Running(request, token, 1, lease_from=time.monotonic() if lease_from is None else lease_from)
    gate.running[token] = entry
    return entry


def _fenced(heartbeat: Heartbeat) -> list[tuple[Running, str]]:
    acted: list[tuple[Running, str]] = []

    def terminate(entry: Running, why: str) -> bool:
        entry.fenced = True
        acted.append((entry, why))
        return True

    heartbeat.fence.terminate = terminate
    return acted


@pytest.mark.parametrize(
    "error",
    [
        sa.exc.OperationalError("renew", {}, Exception("server closed the connection")),
        sa.exc.InterfaceError("renew", {}, Exception("the connection is closed")),
        sa.exc.TimeoutError("QueuePool limit of size 1 overflow 0 reached, connection timed out"),
        sa.exc.ProgrammingError("renew", {}, Exception("a bug")),
        RuntimeError("anything else"),
    ],
    ids=["operational", "interface", "pool-timeout", "programming", "runtime"],
)
def test_every_failed_renewal_counts_towards_the_fence(error: BaseException) -> None:
    """Issue 24 item 4: the fence deadline was checked only in ``except OperationalError``; an ``InterfaceError`` or a
    pool checkout ``TimeoutError`` (both in the breaker's UNREACHABLE list) never fenced. Now no renewal succeeds →
    the deadline passes → the fence acts, whatever the error."""
    ledger = FakeLedger()
    gate = _gate(ledger)
    heartbeat = heartbeat_of(gate)
    acted = _fenced(heartbeat)
    entry = _track(gate, "a")
    start = entry.lease_from
    ledger.fail = error
    for _ in range(3):
        try:
            heartbeat.heartbeat_once()
        except Exception as exc:  # the heartbeat's thread logs what is not "unreachable"
            assert exc is error
    assert entry.lease_from == start  # no renewal succeeded
    assert heartbeat.fence.fence_once(now=start + LEASE - MARGIN - 0.01).fenced == []
    assert heartbeat.fence.fence_once(now=start + LEASE - MARGIN).fenced == [entry.token]
    assert [e for e, _ in acted] == [entry]
    if isinstance(error, sa.exc.OperationalError | sa.exc.InterfaceError | sa.exc.TimeoutError):
        assert gate.opened == [error] * 3  # the breaker opens for every "unreachable" error


def test_the_deadline_counts_from_when_the_renewal_was_sent() -> None:
    """A renewal that took d seconds moved the deadline d seconds too late (it was timed from when it returned,
    while the database counts the lease from its transaction's clock). ``lease_from`` is the time before the send."""
    ledger = FakeLedger()
    gate = _gate(ledger)
    heartbeat = heartbeat_of(gate)
    _fenced(heartbeat)
    entry = _track(gate, "a", lease_from=time.monotonic() - 3.0)
    ledger.delay = 0.3
    before = time.monotonic()
    heartbeat.heartbeat_once()
    after = time.monotonic()
    (sent,) = ledger.called_at
    assert before <= entry.lease_from <= sent < after - 0.25  # the send time, not the return
    assert heartbeat.last_renewal == entry.lease_from
    assert heartbeat.fence.deadline(entry) == entry.lease_from + LEASE - MARGIN


def test_an_attempt_not_renewed_keeps_its_own_deadline() -> None:
    """Only the attempts a renewal renewed move on; one the ledger did not renew (reclaimed) is fenced by the
    heartbeat at once; one claimed after the renewal was sent keeps the time before its own claim."""
    ledger = FakeLedger()
    gate = _gate(ledger)
    heartbeat = heartbeat_of(gate)
    acted = _fenced(heartbeat)
    kept = _track(gate, "kept", lease_from=time.monotonic() - 2.0)
    lost = _track(gate, "lost", lease_from=time.monotonic() - 2.0)
    ledger.renew = lambda held: {h for h in held if h.task_id == "kept"}  # type: ignore[method-assign]
    heartbeat.heartbeat_once()
    assert [e for e, _ in acted] == [lost] and "reclaimed" in acted[0][1]
    assert lost.request.keyed_claim is None and Token("lost", 0) not in gate.running
    assert kept.lease_from > time.monotonic() - 1.0


def test_the_fence_fires_while_the_heartbeat_is_blocked_on_the_ledger() -> None:
    """Silence: a renewal blocked in recv (no client-side timeout) never returns; the fence's own thread fires at the
    deadline anyway and kills the pool process (here a real child process standing in for it)."""
    ledger = FakeLedger()
    gate = _gate(ledger)
    gate.settings.lease, gate.settings.self_fence_margin, gate.settings.heartbeat_interval = 1.2, 0.2, 0.2
    gate.closed = False
    gate.stopping.set()  # no never-started check
    heartbeat = heartbeat_of(gate)
    heartbeat.can_terminate = lambda: True  # type: ignore[method-assign]
    blocked = threading.Event()
    release = threading.Event()

    def renew(held: list[HeldClaim]) -> set[HeldClaim]:
        blocked.set()
        release.wait(60)  # a server gone silent
        raise sa.exc.OperationalError("renew", {}, Exception("server closed the connection"))

    ledger.renew = renew  # type: ignore[method-assign]
    child = subprocess.Popen(["sleep", "60"])
    try:
        entry = _track(gate, "body", pid=child.pid)
        heartbeat.start()
        assert blocked.wait(30)
        assert child.wait(timeout=60) == -signal.SIGKILL  # killed by the fence, the heartbeat still blocked
        assert not release.is_set() and entry.fenced
        assert entry.request.keyed_fenced is not None  # its failure hook will send it back (item 5)
    finally:
        release.set()
        heartbeat.stop()
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()


def test_an_attempt_without_a_pool_process_yet_is_fenced_once_it_has_one() -> None:
    """On prefork, an attempt past its deadline whose request no pool process took yet cannot be killed now; the
    fence asks again at its next look and kills it once it runs (its body must not run on a lapsed lease)."""
    ledger = FakeLedger()
    gate = _gate(ledger)
    heartbeat = heartbeat_of(gate)
    heartbeat.can_terminate = lambda: True  # type: ignore[method-assign]
    entry = _track(gate, "late", lease_from=time.monotonic() - LEASE)
    assert heartbeat.fence.fence_once().fenced == [] and not entry.fenced
    child = subprocess.Popen(["sleep", "60"])
    try:
        entry.request.worker_pid = child.pid
        assert heartbeat.fence.fence_once().fenced == [entry.token]
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()


def test_the_margin_must_be_below_the_lease() -> None:
    with pytest.raises(ValueError, match="below the lease"):
        SelfFence(lease=1.0, margin=1.0, interval=0.1, running=list, terminate=lambda e, w: True)


def test_a_margin_as_long_as_the_lease_is_a_configuration_error() -> None:
    from celery_keyed.ledger.errors import InvalidConfig
    from celery_keyed.settings import read_settings

    with pytest.raises(InvalidConfig, match=r"keyed_self_fence_margin .* must be below keyed_lease"):
        read_settings({"keyed_database_url": "postgresql://u@h/db", "keyed_lease": 6, "keyed_self_fence_margin": 6})


def test_ledger_connections_declare_a_silent_server_dead_within_the_margin() -> None:
    """TCP keepalives and a user timeout on every ledger connection (libpq parameters), derived from the margin:
    a partition without a reset is found by the kernel before the leases could lapse (D19)."""
    from celery_keyed.engine import tcp_keepalive_args
    from celery_keyed.settings import read_settings

    for lease in (60.0, 120.0, 600.0):
        settings = read_settings({"keyed_database_url": "postgresql://u@h/db", "keyed_lease": lease})
        args = tcp_keepalive_args(settings)
        assert args["keepalives"] == 1
        probing = args["keepalives_idle"] + args["keepalives_count"] * args["keepalives_interval"]
        assert probing < settings.self_fence_margin
        assert args["tcp_user_timeout"] < settings.self_fence_margin * 1000


def _killed() -> Any:
    from billiard.einfo import ExceptionInfo
    from billiard.exceptions import WorkerLostError

    try:
        raise WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 0.")
    except WorkerLostError:
        return ExceptionInfo()


def _unwrapped(info: Any) -> Any:
    exc = info.exception
    return getattr(exc, "exc", exc)  # billiard wraps it as Celery receives it; Celery unwraps it


def _received(*, acknowledged: bool) -> Any:
    from kombu.message import Message

    message = Message(
        body=b'[["acct:1"], {}, {}]',
        content_type="application/json",
        content_encoding="utf-8",
        headers={"id": "t-1", "task": "t", "retries": 0, "keyed_nonce": "stale"},
        properties={"priority": 3},
        delivery_info={"exchange": "", "routing_key": "fenced"},
    )
    return SimpleNamespace(name="t", id="t-1", acknowledged=acknowledged, _message=message, keyed_fenced="why")


def test_a_killed_body_acked_at_its_start_is_published_again_as_received() -> None:
    """Item 5: acks_late off, the message was acked when the body started; the failure Celery sees is a requeueing
    Reject (no failure result, no requeue of its own: the message is acked) and the copy is in the broker."""
    from celery import Celery
    from celery.exceptions import Reject

    from celery_keyed.headers import HEADER_NONCE
    from celery_keyed.request import failure_outcome
    from celery_keyed.worker.fence import readmit_fenced

    app = Celery("fence-test", broker="memory://", set_as_current=False)
    request = _received(acknowledged=True)
    info = readmit_fenced(app, request, _killed())
    assert isinstance(_unwrapped(info), Reject) and _unwrapped(info).requeue
    request.task = SimpleNamespace(acks_late=False, reject_on_worker_lost=False)
    assert failure_outcome(request, info).value == "worker_lost"  # the task stays open; its copy is admitted again
    with app.connection_for_read() as conn:
        copy = conn.SimpleQueue("fenced").get(timeout=5)
        assert copy.headers["id"] == "t-1" and HEADER_NONCE not in copy.headers
        assert copy.body == b'[["acct:1"], {}, {}]' and copy.properties.get("priority") == 3


def test_a_killed_body_still_unacked_is_left_to_celerys_requeue() -> None:
    from celery.exceptions import Reject

    from celery_keyed.worker.fence import readmit_fenced

    app = SimpleNamespace(producer_pool=None)  # not used: nothing is published
    info = readmit_fenced(app, _received(acknowledged=False), _killed())
    assert isinstance(_unwrapped(info), Reject) and _unwrapped(info).requeue


def test_a_copy_that_cannot_be_published_leaves_the_failure() -> None:
    from celery_keyed.worker.fence import readmit_fenced

    class Broken:
        def acquire(self, **_: Any) -> Any:
            raise ConnectionError("the broker is down")

    killed = _killed()
    assert readmit_fenced(SimpleNamespace(producer_pool=Broken()), _received(acknowledged=True), killed) is killed


def test_a_body_that_ended_on_its_own_keeps_its_outcome() -> None:
    from billiard.einfo import ExceptionInfo

    from celery_keyed.worker.fence import readmit_fenced

    try:
        raise ValueError("its own failure, just before the kill")
    except ValueError:
        own = ExceptionInfo()
    assert readmit_fenced(SimpleNamespace(producer_pool=None), _received(acknowledged=True), own) is own
