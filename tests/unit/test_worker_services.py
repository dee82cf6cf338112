"""The worker's services driven directly, with a stand-in gate and ledger (no database, no worker): the one
dispatch policy of promotions, and the releaser's batches, order, start / stop twice and kept releases."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Outcome, Promotion, ReleaseReport, Token
from celery_keyed.worker.handoff import Route, route
from celery_keyed.worker.heartbeat import Heartbeat
from celery_keyed.worker.releaser import Releaser
from celery_keyed.worker.sweeper import Sweeper


def promotion(*, nonce: bool) -> Promotion:
    return Promotion("t", 0, uuid.uuid4() if nonce else None, 7, "k:1", None, "celery", {"task": "t"})


def decide(p: Promotion, **changes: bool) -> Route:
    given = dict(on_loop=True, closed=False, local_handoff=True, consumes=True, pool_has_room=True, loop_runs=True)
    given.update(changes)
    return route(p, **given)


@pytest.mark.parametrize("nonce", [True, False])
def test_the_dispatch_policy(nonce: bool) -> None:
    p = promotion(nonce=nonce)
    assert decide(p) is Route.RUN_HERE  # on the loop, this worker consumes its queue: local handoff (D4)
    assert decide(p, on_loop=False) is Route.TO_LOOP  # found off the loop: the loop runs it
    assert decide(p, on_loop=False, loop_runs=False) is Route.REPUBLISH  # no loop takes work from us
    assert decide(p, closed=True) is Route.REPUBLISH  # shutting down: nothing new starts here
    assert decide(p, local_handoff=False) is Route.REPUBLISH
    assert decide(p, consumes=False) is Route.REPUBLISH
    # A busy pool: a promotion with a nonce goes to any worker; one already bound here (no nonce) is run here,
    # where it waits for a pool process (the heartbeat gives it back if none takes it).
    assert decide(p, pool_has_room=False) is (Route.REPUBLISH if nonce else Route.RUN_HERE)


class FakeLedger:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.fail: BaseException | None = None
        self.pins = 0

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:  # the releaser's thread keeps one connection for its lifetime
        self.pins += 1
        yield

    def warm_up(self) -> None:
        self.calls.append(("warm_up", []))

    def release(self, token: Token, fence: int, outcome: Outcome, **kw: Any) -> ReleaseReport:
        if self.fail is not None:
            raise self.fail
        self.calls.append(("release", [token.task_id]))
        return ReleaseReport(released=True)

    def release_many(self, requests: list[Any]) -> list[ReleaseReport]:
        if self.fail is not None:
            raise self.fail
        self.calls.append(("release_many", [r.token.task_id for r in requests]))
        return [ReleaseReport(released=True) for _ in requests]


def fake_gate() -> SimpleNamespace:
    on_loop: list[Any] = []
    gate = SimpleNamespace(
        closed=False,
        ledger=FakeLedger(),
        on_loop=on_loop,
        handoff=SimpleNamespace(
            local_handoff=lambda released=None: (None, None),
            call_on_loop=on_loop.append,
            dispatch=lambda promotions, local, granted=None: None,
        ),
        breaker=SimpleNamespace(open=lambda exc: None),
    )
    return gate


def releaser_of(gate: Any, **kwargs: Any) -> Releaser:
    """A releaser whose collaborators are the fake gate's."""
    ledger, handoff, breaker = (getattr(gate, name, None) for name in ("ledger", "handoff", "breaker"))
    return Releaser(ledger=ledger, handoff=handoff, breaker=breaker, life=gate, **kwargs)


def handoff_of(gate: Any) -> Any:
    """A handoff whose collaborators are the fake gate's."""
    from celery_keyed.worker.handoff import Handoff

    fields = ("app", "settings", "consumer", "ledger")
    handoff = Handoff(**{name: getattr(gate, name, None) for name in fields}, life=gate, lock=threading.Lock())
    handoff.releaser, handoff.held_mutex_keys = gate.releaser, getattr(gate, "held_mutex_keys", None)
    return handoff


def heartbeat_of(gate: Any) -> Any:
    """A heartbeat whose collaborators are the fake gate's."""
    fields = ("settings", "consumer", "ledger", "lock", "running", "handoff", "releaser", "breaker", "revokes")
    heartbeat = Heartbeat(**{name: getattr(gate, name, None) for name in fields}, life=gate)
    heartbeat.check_cancels = getattr(gate, "check_cancels", lambda: None)
    return heartbeat


def hand(releaser: Releaser, task_id: str, after: Any = None) -> None:
    releaser.hand_over(Token(task_id, 0), 1, Outcome.COMPLETED, key="k:1", name="t", contended=False, after=after)


def test_the_releaser_gives_back_in_batches_in_order() -> None:
    gate = fake_gate()
    releaser = releaser_of(gate, batch=3)  # type: ignore[arg-type]
    releaser._accepting = True  # as start() does, without the thread: release_once is called by the test
    for n in range(7):
        hand(releaser, f"r{n}")
    while releaser.release_once():
        pass
    assert gate.ledger.calls == [
        ("release_many", ["r0", "r1", "r2"]),
        ("release_many", ["r3", "r4", "r5"]),
        ("release", ["r6"]),  # a batch of one: the single release
    ]


def test_the_releaser_starts_and_stops_twice_and_loses_nothing() -> None:
    gate = fake_gate()
    releaser = releaser_of(gate)  # type: ignore[arg-type]
    releaser.start()
    releaser.start()
    assert [t.name for t in threading.enumerate()].count("keyed-releaser") == 1
    for n in range(20):
        hand(releaser, f"r{n}")
    releaser.stop()
    releaser.stop()
    assert [t.name for t in threading.enumerate()].count("keyed-releaser") == 0
    assert [task for _, tasks in gate.ledger.calls for task in tasks] == [f"r{n}" for n in range(20)]
    assert releaser.queued() == 0
    hand(releaser, "late")  # stopped: runs in the caller's thread
    assert gate.ledger.calls[-1] == ("release", ["late"])
    releaser.start()  # a consumer restart (broker reconnect) starts it again
    hand(releaser, "again")
    releaser.stop()
    assert gate.ledger.calls[-1] == ("release", ["again"])
    assert gate.ledger.pins == 2  # each run of the thread kept one ledger connection (Ledger.pinned)
    assert ("warm_up", []) not in gate.ledger.calls  # no keyed work announced: no warm-up


def _wait_idle(releaser: Releaser, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not releaser.idle():
        assert time.monotonic() < deadline, "the releaser kept its releases"
        time.sleep(0.01)


def test_releases_of_keys_without_a_line_linger_to_share_a_round_trip_until_a_line_needs_one() -> None:
    """The releaser thread holds releases of keys without a line here (not contended) up to ``linger`` for others to
    share their round trip; a release of a contended key ends the wait at once, and they all go in one call."""
    import time

    gate = fake_gate()
    releaser = releaser_of(gate, linger=30.0)  # type: ignore[arg-type]
    releaser.start()
    try:
        for n in range(3):
            hand(releaser, f"r{n}")
        time.sleep(0.3)
        assert gate.ledger.calls == []  # lingering: nobody waits for these keys
        releaser.hand_over(Token("c", 0), 1, Outcome.COMPLETED, key="k:2", name="t", contended=True)
        _wait_idle(releaser)  # well before the linger ends
        assert gate.ledger.calls == [("release_many", ["r0", "r1", "r2", "c"])]
    finally:
        releaser.stop()


def test_releases_handed_over_during_a_batch_linger_for_the_next_one() -> None:
    """The releaser thread gives back one batch per look: releases of keys without a line, handed over while a
    batch is in the ledger, wait for the next look's linger to share its round trip (not a call of their own the
    moment the batch ends)."""
    import time

    gate = fake_gate()
    entered, proceed = threading.Event(), threading.Event()
    release_many = gate.ledger.release_many

    def slow_release_many(requests: list[Any]) -> list[ReleaseReport]:
        entered.set()
        proceed.wait(10)
        return release_many(requests)

    gate.ledger.release_many = slow_release_many
    releaser = releaser_of(gate, linger=30.0)  # type: ignore[arg-type]
    releaser.start()
    try:
        hand(releaser, "r0")
        releaser.hand_over(Token("c", 0), 1, Outcome.COMPLETED, key="k:2", name="t", contended=True)
        assert entered.wait(10)  # the first batch is in the ledger
        for n in (1, 2, 3):
            hand(releaser, f"r{n}")
        proceed.set()
        time.sleep(0.3)
        assert gate.ledger.calls == [("release_many", ["r0", "c"])]  # r1-r3 linger for the next look
        releaser.hand_over(Token("c2", 0), 1, Outcome.COMPLETED, key="k:2", name="t", contended=True)  # ends it
        _wait_idle(releaser)
        assert gate.ledger.calls == [("release_many", ["r0", "c"]), ("release_many", ["r1", "r2", "r3", "c2"])]
    finally:
        releaser.stop()


def test_an_admission_of_a_key_whose_release_lingers_has_it_commit_first_and_a_stop_ends_the_linger() -> None:
    """``Releaser.settle`` (an admission's thread, before it claims): a release of one of its keys waiting in the
    releaser goes now, and settle returns once it has committed — the arrival finds the slot its own worker freed
    instead of parking behind it. Other keys' releases go on lingering; a stop gives them back at once."""
    import time

    gate = fake_gate()
    releaser = releaser_of(gate, linger=30.0)  # type: ignore[arg-type]
    releaser.start()
    try:
        hand(releaser, "r0")  # key k:1
        assert releaser.settle({"k:1"}, timeout=10.0)
        assert gate.ledger.calls == [("release", ["r0"])]
        hand(releaser, "r1")
        assert releaser.settle({"k:9"}, timeout=10.0)  # nothing of k:9 waits: no hurry
        time.sleep(0.3)
        assert gate.ledger.calls == [("release", ["r0"])]
    finally:
        started = time.monotonic()
        releaser.stop()
    assert time.monotonic() - started < 10.0  # well before the linger ends
    assert gate.ledger.calls == [("release", ["r0"]), ("release", ["r1"])]
    assert releaser.settle({"k:1"})  # stopped, nothing waits


def test_the_releaser_warms_its_connection_up_once_keyed_work_is_announced() -> None:
    """``request_warm`` (the gate's first keyed arrival): the idle releaser thread warms its connection up once; the
    thread of a later start (a consumer restart: a new connection) does it again when idle."""
    import time

    gate = fake_gate()

    def warmed(count: int) -> bool:
        deadline = time.monotonic() + 10
        while [name for name, _ in gate.ledger.calls].count("warm_up") < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return [name for name, _ in gate.ledger.calls].count("warm_up") == count

    releaser = releaser_of(gate)  # type: ignore[arg-type]
    releaser.start()
    releaser.request_warm()
    assert warmed(1)
    hand(releaser, "r0")
    releaser.stop()
    assert [name for name, _ in gate.ledger.calls] == ["warm_up", "release"]
    releaser.start()
    assert warmed(2)
    hand(releaser, "r1")
    releaser.stop()
    assert [name for name, _ in gate.ledger.calls] == ["warm_up", "release", "warm_up", "release"]


def test_a_release_that_cannot_commit_is_kept_with_its_ack_and_retried() -> None:
    gate = fake_gate()
    releaser = releaser_of(gate)  # type: ignore[arg-type]
    releaser._accepting = True
    acked: list[str] = []
    gate.ledger.fail = sa.exc.OperationalError("SELECT 1", {}, Exception("down"))
    hand(releaser, "a", after=lambda: acked.append("a"))
    hand(releaser, "b", after=lambda: acked.append("b"))
    releaser.release_once()
    assert [j.token.task_id for j in releaser.pending] == ["a", "b"] and acked == []  # D15: no ack before commit
    releaser.flush_pending()  # still down
    assert len(releaser.pending) == 2
    gate.ledger.fail = None
    releaser.flush_pending()
    assert not releaser.pending
    for call in gate.on_loop:  # the acks go back to the loop (kombu's channel is the loop's)
        call()
    assert acked == ["a", "b"]


def test_the_heartbeat_and_the_sweeper_start_and_stop_twice() -> None:
    gate = SimpleNamespace(
        settings=SimpleNamespace(heartbeat_interval=60.0, sweep_interval=60.0, lease=360.0, self_fence_margin=60.0),
        consumer=SimpleNamespace(pool=None),
    )
    heartbeat = heartbeat_of(gate)
    sweeper = Sweeper(
        app=None, settings=gate.settings, ledger=None, breaker=None, handoff=None, announce_never_ran=lambda *a: None
    )
    for service, name in ((heartbeat, "keyed-heartbeat"), (sweeper, "keyed-sweeper")):
        service.start()
        service.start()
        assert [t.name for t in threading.enumerate()].count(name) == 1
        service.stop()
        service.stop()
        assert [t.name for t in threading.enumerate()].count(name) == 0


def test_the_pool_counts_as_busy_only_with_requests_that_will_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Handoff.pool_has_room``: received requests of keys with a line here will park and give their process back
    at once, so they do not make the pool look busy — a task with several keys too (a list header), when any of
    its keys has a line. Counted busy, the pool would make every promotion be published behind the broker's queue."""

    from celery.worker import state as worker_state

    from celery_keyed.headers import HEADER_KEY

    gate = SimpleNamespace(consumer=SimpleNamespace(pool=SimpleNamespace(num_processes=1)), releaser=None)
    releaser = releaser_of(gate)  # type: ignore[arg-type]
    gate.releaser = releaser
    handoff = handoff_of(gate)

    class Received:  # hashable, as Celery's requests are (they live in sets)
        def __init__(self, key: object) -> None:
            self.keyed_arrival_key = None
            self._request_dict = {HEADER_KEY: key}

    def received(key: object) -> Received:
        return Received(key)

    releaser.mark_contended("tenant:1")
    parking = [received(["api:x", "tenant:1"]), received("tenant:1")]  # will park: a key has a line here
    monkeypatch.setattr(worker_state, "reserved_requests", set(parking))
    monkeypatch.setattr(worker_state, "active_requests", set())
    assert handoff.pool_has_room()
    running = [received(["api:x", "tenant:2"])]  # will run: no key of it has a line here
    monkeypatch.setattr(worker_state, "reserved_requests", set(parking + running))
    assert not handoff.pool_has_room()


def test_requests_of_a_mutex_running_here_or_of_the_released_key_do_not_make_the_pool_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Handoff.pool_has_room``: a received request of a mutex key whose attempt holds its claim here
    (``Receipt.held_mutex_keys``), or of the key whose release asks (its room goes to its line first), will park
    and give its process back at once. Counted as work that will run, it made a burst's promotions be published
    behind the broker's whole queue (bench.gate d: 500-1000 ms handoffs) instead of started here."""

    from celery.worker import state as worker_state

    from celery_keyed.headers import HEADER_KEY

    held: set[str] = {"acct:1"}
    gate = SimpleNamespace(
        consumer=SimpleNamespace(pool=SimpleNamespace(num_processes=1)),
        releaser=None,
        held_mutex_keys=lambda: set(held),
    )
    gate.releaser = releaser_of(gate)  # type: ignore[arg-type]
    handoff = handoff_of(gate)

    class Received:
        def __init__(self, key: object) -> None:
            self.keyed_arrival_key = None
            self._request_dict = {HEADER_KEY: key}

    monkeypatch.setattr(worker_state, "active_requests", set())
    monkeypatch.setattr(worker_state, "reserved_requests", {Received("acct:1"), Received(["acct:1", "api:x"])})
    assert handoff.pool_has_room()  # both will park: acct:1 runs here
    held.clear()
    assert not handoff.pool_has_room()  # acct:1 no longer runs here: they may run
    assert handoff.pool_has_room("acct:1")  # unless acct:1 is the key being released (its line goes first)
    assert not handoff.pool_has_room("acct:2")
    # The request that holds acct:1's claim here, admitted and about to start (Celery does not count it active yet),
    # is work that will run: its key being held by its own claim does not make it a request that will park. (CI: a
    # promotion was started here behind it, with the only process about to be taken.)
    admitted = Received("acct:1")
    admitted.keyed_claim = object()  # type: ignore[attr-defined]
    monkeypatch.setattr(worker_state, "reserved_requests", {admitted})
    held.add("acct:1")
    assert not handoff.pool_has_room()


def test_held_mutex_keys_are_the_running_keys_of_names_configured_as_mutexes() -> None:
    """``Receipt.held_mutex_keys``: keys whose attempt holds its claim here, when their name's configured
    limit is 1 (or the name is not configured); a gate's key (limit > 1) has room for more."""
    import threading as _threading

    from celery_keyed.gate import Running
    from celery_keyed.headers import HEADER_KEY
    from celery_keyed.ledger import Token
    from celery_keyed.settings import NameConfig
    from celery_keyed.worker.receipt import Receipt

    def running(task_id: str, key: str) -> Running:
        return Running(SimpleNamespace(_request_dict={HEADER_KEY: key}), Token(task_id, 0), 1)

    from celery_keyed.worker.handoff import Prebound

    gate = SimpleNamespace(
        lock=_threading.Lock(),
        running={
            Token("a", 0): running("a", "acct:1"),
            Token("b", 0): running("b", "stripe:global"),
            Token("c", 0): running("c", "solo:9"),
        },
        handoff=SimpleNamespace(prebound={}),
        settings=SimpleNamespace(
            limits={"stripe": NameConfig("stripe", limit=100), "solo": NameConfig("solo", limit=1)}
        ),
    )
    assert Receipt.held_mutex_keys(gate) == {"acct:1", "solo:9"}  # type: ignore[arg-type]
    # A claim bound here that waits for its request (a promotion, or a claim taken ahead) holds its key too.
    gate.handoff.prebound[Token("d", 0)] = Prebound(7, "acct:2", ahead=True)
    gate.handoff.prebound[Token("e", 0)] = Prebound(8, "stripe:eu")
    assert Receipt.held_mutex_keys(gate) == {"acct:1", "acct:2", "solo:9"}  # type: ignore[arg-type]
    # The question about one key (every received request asks it) answers as the set does.
    for key in ("acct:1", "acct:2", "acct:3", "solo:9", "solo:8", "stripe:global", "stripe:eu", "other:1"):
        held = Receipt._mutex_held_here(gate, key)  # type: ignore[arg-type]
        assert held == (key in {"acct:1", "acct:2", "solo:9"}), key


@pytest.mark.parametrize("nonce", [False, True])
def test_a_published_promotion_is_never_parked_at_receipt(monkeypatch: pytest.MonkeyPatch, nonce: bool) -> None:
    """``Receipt.receive``: a request carrying a promotion's nonce is already bound in the ledger (D5): it goes
    straight on to its admission, which confirms it; sent to the receipt service it would cost a round trip that
    cannot park it, while a pool process waits for it. A plain arrival of a key with a line here is parked there."""
    from celery_keyed.headers import HEADER_KEY, HEADER_NONCE
    from celery_keyed.worker import intake
    from celery_keyed.worker.receipt import Receipt

    submitted: list[Any] = []
    receipts = SimpleNamespace(accepting=True, submit=lambda job: submitted.append(job) or True)
    gate = SimpleNamespace(
        settings=SimpleNamespace(park_at_receipt=True),
        receipts=receipts,
        breaker=SimpleNamespace(is_open=False),
        closed=False,
        stopping=threading.Event(),
        releaser=SimpleNamespace(is_contended=lambda key: True),
        ledger=SimpleNamespace(parks_at_receipt=lambda arrival: True),
        _line_here=lambda request, key: False,
        generation=1,
    )
    monkeypatch.setattr(intake, "arrival_for", lambda request: SimpleNamespace(key="account:1"))
    headers: dict[str, Any] = {HEADER_KEY: "account:1"}
    if nonce:
        headers[HEADER_NONCE] = "n-1"
    request = SimpleNamespace(_request_dict=headers, keyed_claim=None)
    handled: list[Any] = []
    gate._receipt_job = Receipt._receipt_job.__get__(gate)  # type: ignore[attr-defined]
    gate._decline_promotion = lambda request: False  # type: ignore[attr-defined]
    gate._warm_services = lambda: None  # type: ignore[attr-defined]
    _receipt_plumbing(gate)
    answer = Receipt.receive(gate, request, lambda r: handled.append(r) or "handled")  # type: ignore[arg-type]
    if nonce:
        assert (answer, handled, submitted) == ("handled", [request], [])
    else:
        assert (answer, handled, len(submitted)) == (None, [], 1)


@pytest.mark.parametrize(
    ("limits", "running_key", "parked_at_receipt"),
    [
        ({}, "account:1", True),  # a mutex (the default) held here: no room, parked at receipt
        ({"account": SimpleNamespace(limit=1)}, "account:1", True),
        ({"account": SimpleNamespace(limit=5)}, "account:1", False),  # a gate may have room: admission decides
        ({}, "account:2", False),  # another key runs here: this one may have room
    ],
)
def test_an_arrival_of_a_mutex_key_running_here_is_parked_at_receipt(
    monkeypatch: pytest.MonkeyPatch, limits: dict[str, Any], running_key: str, parked_at_receipt: bool
) -> None:
    """``Receipt.receive``: before its key ever parked or promoted here (not contended), an arrival of a mutex
    key whose attempt runs in this worker goes to the receipt service, which parks it without a pool process."""
    from celery_keyed.gate import Running
    from celery_keyed.headers import HEADER_KEY
    from celery_keyed.ledger import Token
    from celery_keyed.worker import intake
    from celery_keyed.worker.receipt import Receipt

    submitted: list[Any] = []
    receipts = SimpleNamespace(accepting=True, submit=lambda job: submitted.append(job) or True)
    holder = SimpleNamespace(_request_dict={HEADER_KEY: running_key})
    gate = SimpleNamespace(
        settings=SimpleNamespace(park_at_receipt=True, limits=limits),
        receipts=receipts,
        breaker=SimpleNamespace(is_open=False),
        closed=False,
        stopping=threading.Event(),
        releaser=SimpleNamespace(is_contended=lambda key: False),
        ledger=SimpleNamespace(parks_at_receipt=lambda arrival: True),
        lock=threading.Lock(),
        running={Token("held", 0): Running(holder, Token("held", 0), 1)},
        handoff=SimpleNamespace(prebound={}),
        _line_here=lambda request, key: False,
        generation=1,
    )
    gate._mutex_held_here = lambda key: Receipt._mutex_held_here(gate, key)  # type: ignore[attr-defined]
    gate.held_mutex_keys = lambda: Receipt.held_mutex_keys(gate)  # type: ignore[attr-defined]
    monkeypatch.setattr(intake, "arrival_for", lambda request: SimpleNamespace(key="account:1"))
    request = SimpleNamespace(_request_dict={HEADER_KEY: "account:1"}, keyed_claim=None)
    handled: list[Any] = []
    gate._receipt_job = Receipt._receipt_job.__get__(gate)  # type: ignore[attr-defined]
    gate._decline_promotion = lambda request: False  # type: ignore[attr-defined]
    gate._warm_services = lambda: None  # type: ignore[attr-defined]
    _receipt_plumbing(gate)
    answer = Receipt.receive(gate, request, lambda r: handled.append(r) or "handled")  # type: ignore[arg-type]
    if parked_at_receipt:
        assert (answer, handled, len(submitted)) == (None, [], 1)
    else:
        assert (answer, handled, submitted) == ("handled", [request], [])


def _receipt_plumbing(gate: Any) -> None:
    """The receipt service's bookkeeping of the real gate on a fake one (claims ahead off)."""
    from celery_keyed.worker.receipt import Receipt

    gate._at_receipt = {}
    gate._submit_receipt = Receipt._submit_receipt.__get__(gate)
    gate._pass_job = Receipt._pass_job.__get__(gate)
    gate._ahead_job = lambda request, handle: None


def _waiting_gate(monkeypatch: pytest.MonkeyPatch, held: set[str]) -> tuple[Any, Any, list[Any]]:
    """A gate with a pool semaphore whose line the test fills (kombu's LaxBoundedSemaphore: (callback, args, kwargs)
    entries) and a receipt service that records what it is handed."""
    import threading as _threading
    from collections import deque

    from celery_keyed.worker import intake
    from celery_keyed.worker.receipt import Receipt

    submitted: list[Any] = []
    semaphore = SimpleNamespace(_waiting=deque())
    requests_sent_back: list[Any] = []

    def on_task_request(request: Any) -> None:  # no process free: Celery queues it at the line's end
        requests_sent_back.append(request)
        semaphore._waiting.append((lambda r: None, (request,), {}))

    gate = SimpleNamespace(
        settings=SimpleNamespace(park_at_receipt=True),
        receipts=SimpleNamespace(accepting=True, submit=lambda job: submitted.append(job) or True),
        breaker=SimpleNamespace(is_open=False),
        closed=False,
        stopping=_threading.Event(),
        generation=1,
        consumer=SimpleNamespace(controller=SimpleNamespace(semaphore=semaphore), on_task_request=on_task_request),
        releaser=SimpleNamespace(is_contended=lambda key: False),
        ledger=SimpleNamespace(parks_at_receipt=lambda arrival: True),
        held_mutex_keys=lambda: set(held),
        _returned=0,
        lock=_threading.Lock(),
        handoff=SimpleNamespace(prebound={}),
    )
    for name in ("park_waiting", "_park_waiting", "_undecided_keys", "_back_in_line"):
        setattr(gate, name, getattr(Receipt, name).__get__(gate))
    _receipt_plumbing(gate)
    monkeypatch.setattr(intake, "arrival_for", lambda request: SimpleNamespace(key=request._request_dict["keyed_key"]))
    return gate, semaphore, submitted


class _Request:
    def __init__(self, name: str, key: str | None) -> None:
        self.id = name
        self.keyed_claim = None
        self._request_dict = {"keyed_key": key}


def test_requests_waiting_for_a_pool_process_of_a_busy_key_go_to_the_receipt_service_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Receipt.park_waiting``: the requests in the pool semaphore's line whose key runs here (a mutex) are taken
    out of it and handed to the receipt service in their order; the others keep their places. A key with a request
    whose admission is under way (it holds a process, its decision not back) is left alone: its later requests must
    not reach the ledger before it (D10)."""
    from celery.worker import state as worker_state

    gate, semaphore, submitted = _waiting_gate(monkeypatch, held={"acct:1"})
    from celery_keyed.ledger import Token

    r1, other, r2, r3 = _Request("r1", "acct:1"), _Request("u", None), _Request("r2", "acct:1"), _Request("r3", "b:2")
    promoted = _Request("p", "acct:1")  # a promotion bound here (D4): it starts when a process frees, never parks
    gate.handoff.prebound[Token("p", 0)] = object()
    for request in (promoted, r1, other, r2, r3):
        semaphore._waiting.append((lambda r: None, (request,), {}))
    monkeypatch.setattr(worker_state, "reserved_requests", {promoted, r1, other, r2, r3})
    monkeypatch.setattr(worker_state, "active_requests", set())
    assert gate.park_waiting() == 2
    assert [job.request.id for job in submitted] == ["r1", "r2"]
    assert all(job.extra["receipt"] for job in submitted)
    assert [entry[1][0].id for entry in semaphore._waiting] == ["p", "u", "r3"]
    semaphore._waiting.popleft()
    assert gate.park_waiting() == 0  # taken once only

    flight = _Request("f", "b:2")  # b:2 now busy here, but a request of it is being admitted
    monkeypatch.setattr(worker_state, "reserved_requests", {other, r3, flight})
    gate.held_mutex_keys = lambda: {"b:2"}
    assert gate.park_waiting() == 0
    assert [entry[1][0].id for entry in semaphore._waiting] == ["u", "r3"]
    flight.keyed_claim = ("token", 1)  # admitted: the line of b:2 here is r3 alone
    assert gate.park_waiting() == 1
    assert submitted[-1].request.id == "r3"


def test_a_decided_batch_gives_its_pool_processes_back_after_parking_what_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Start._admitted``: a parked request's pool process is given back once ``park_waiting`` has looked, so
    the requests of its key waiting in the pool semaphore's line are parked at receipt together, in order, and the
    process goes to the next request that will run. Given back at once, it went to the key's next request, whose
    admission was then under way (D10 kept the key where it was), and a burst was parked one request at a time."""
    from celery.worker import state as worker_state

    from celery_keyed.worker.start import Start

    gate, semaphore, submitted = _waiting_gate(monkeypatch, held={"acct:1"})
    given: list[str] = []

    def pool_release() -> None:  # kombu's semaphore: the freed process goes to the first request waiting
        if semaphore._waiting:
            given.append(semaphore._waiting.popleft()[1][0].id)

    gate._pool_release = pool_release
    gate._frees = None
    gate._free_pool_slot = Start._free_pool_slot.__get__(gate)
    gate._start_decided = lambda job: gate._free_pool_slot()  # the batch's one verdict: parked, its process freed
    r1, other, r2 = _Request("r1", "acct:1"), _Request("u", None), _Request("r2", "acct:1")
    for request in (r1, other, r2):
        semaphore._waiting.append((lambda r: None, (request,), {}))
    monkeypatch.setattr(worker_state, "reserved_requests", {r1, other, r2})
    monkeypatch.setattr(worker_state, "active_requests", set())
    Start._admitted(gate, [SimpleNamespace(request=_Request("r0", "acct:1"))])  # type: ignore[arg-type]
    assert [job.request.id for job in submitted] == ["r1", "r2"]  # parked together, in order
    assert given == ["u"]  # the process went to the request that will run
    assert gate._frees is None
    gate._free_pool_slot()  # outside a batch: given back at once
    assert given == ["u"] and not semaphore._waiting


def test_requests_sent_back_undecided_return_to_the_front_of_the_line_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Receipt._back_in_line``: requests taken out of the pool semaphore's line that the ledger did not park
    (room after all) go back to its front, in the order they were taken, ahead of requests received after them."""
    gate, semaphore, _ = _waiting_gate(monkeypatch, held={"acct:1"})
    semaphore._waiting.append((lambda r: None, (_Request("later", None),), {}))
    first, second = _Request("r1", "acct:1"), _Request("r2", "acct:1")
    gate._returned = 0
    gate._back_in_line(first)
    gate._back_in_line(second)
    assert [entry[1][0].id for entry in semaphore._waiting] == ["r1", "r2", "later"]


def test_a_busy_pool_of_short_runs_still_takes_a_promotion(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Handoff.pool_has_room``: every process has work that will run, but the runs here are short (the typical run
    over the processes at most ``SOON``): the first process frees within one short run, so the promotion starts here
    (ahead of the waiting requests) instead of waiting behind the broker's queue. Long runs publish it."""

    from celery.worker import state as worker_state

    from celery_keyed.headers import HEADER_KEY
    from celery_keyed.worker.handoff import SOON

    gate = SimpleNamespace(consumer=SimpleNamespace(pool=SimpleNamespace(num_processes=2)), releaser=None)
    gate.releaser = releaser_of(gate)  # type: ignore[arg-type]
    handoff = handoff_of(gate)

    class Received:
        def __init__(self, key: str) -> None:
            self.keyed_arrival_key = None
            self._request_dict = {HEADER_KEY: key}

    monkeypatch.setattr(worker_state, "active_requests", set())
    monkeypatch.setattr(worker_state, "reserved_requests", {Received("a:1"), Received("b:1")})
    assert not handoff.pool_has_room()  # no run seen yet: busy
    for _ in range(20):
        handoff.note_run(2 * SOON * 0.9)  # typical run / 2 processes = 0.9 SOON
    assert handoff.pool_has_room()
    for _ in range(40):
        handoff.note_run(30.0)
    assert not handoff.pool_has_room()


def test_a_promotion_waiting_for_a_process_is_no_line_for_later_arrivals(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Receipt._line_here``: a received request whose admission is not decided keeps later arrivals of its key
    from parking at receipt before it (D10) — but a promotion (bound here, or carrying a nonce) left the key's line in
    the ledger already: arrivals behind it park at once instead of each waiting for a process."""
    from celery.worker import state as worker_state

    from celery_keyed.headers import HEADER_NONCE
    from celery_keyed.ledger import Token

    gate, _, _ = _waiting_gate(monkeypatch, held=set())
    bound, published, plain, new = (
        _Request("bound", "acct:1"), _Request("nonce", "acct:1"), _Request("plain", "acct:1"), _Request("new", "acct:1")
    )
    published._request_dict[HEADER_NONCE] = "6a1f0000-0000-4000-8000-000000000000"
    gate.handoff.prebound[Token("bound", 0)] = object()
    from celery_keyed.worker.receipt import Receipt

    line_here = Receipt._line_here.__get__(gate)
    monkeypatch.setattr(worker_state, "active_requests", set())
    monkeypatch.setattr(worker_state, "reserved_requests", {bound, published, new})
    assert not line_here(new, "acct:1")
    monkeypatch.setattr(worker_state, "reserved_requests", {bound, published, plain, new})
    assert line_here(new, "acct:1")


def test_a_request_of_several_keys_or_a_hostile_key_header_waiting_here_breaks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Receipt._line_here`` on a worker holding a request whose key header is a list (a task of several keys)
    or any other JSON value: a list's string keys are lines like a single key's (a later arrival of one of them does
    not park before it, D10); anything else is no key. It raised TypeError (unhashable list) on the consumer loop,
    which killed the worker (the demo's partner-API tasks, found in the sixth session)."""
    from celery.worker import state as worker_state

    from celery_keyed.headers import HEADER_KEY
    from celery_keyed.worker.receipt import Receipt

    gate, _, _ = _waiting_gate(monkeypatch, held=set())
    several, new = _Request("several", "api"), _Request("new", "tenant:t1")
    several._request_dict[HEADER_KEY] = ["api", "tenant:t1"]
    hostile = [_Request(f"h{i}", "x") for i in range(4)]
    for request, value in zip(hostile, [{"a": 1}, [["nested"]], 7, None], strict=True):
        request._request_dict[HEADER_KEY] = value
    line_here = Receipt._line_here.__get__(gate)
    monkeypatch.setattr(worker_state, "active_requests", set())
    monkeypatch.setattr(worker_state, "reserved_requests", {*hostile, new})
    assert not line_here(new, "tenant:t1")
    monkeypatch.setattr(worker_state, "reserved_requests", {*hostile, several, new})
    assert line_here(new, "tenant:t1")
    assert not line_here(new, "tenant:t2")


def test_a_fault_of_the_receipt_shortcuts_never_reaches_the_consumer_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Receipt.receive`` and ``park_waiting`` run on Celery's consumer loop, where an exception is an
    "Unrecoverable error" that stops the worker: a fault in either leaves the request on Celery's own path (it waits
    for a pool process, where its admission decides) and the worker running."""
    from celery_keyed.worker.receipt import Receipt

    def broken(*args: object, **kwargs: object) -> None:
        raise TypeError("unhashable type: 'list'")

    handled: list[object] = []
    gate = SimpleNamespace(_receipt_job=broken, _park_waiting=broken, receipts=None, _warm_services=lambda: None)
    request = _Request("r", "acct:1")
    assert Receipt.receive(gate, request, handled.append) is None  # type: ignore[arg-type]
    assert handled == [request]
    assert Receipt.park_waiting(gate) == 0  # type: ignore[arg-type]
    given_back = _Request("given back", "acct:1")  # the fault came after its message went back to the broker
    given_back.acknowledged = True  # type: ignore[attr-defined]
    monkeypatch.setattr("celery.worker.state.task_ready", lambda request: None)
    assert Receipt.receive(gate, given_back, handled.append) is None  # type: ignore[arg-type]
    assert handled == [request]  # it never also runs here


class _Promotion:
    """A received request of a published promotion (it carries a nonce), as Celery's strategy hands it over."""

    def __init__(self, nonce: object) -> None:
        from celery_keyed.headers import HEADER_KEY, HEADER_NONCE

        self.id = "p"
        self.acknowledged = False
        self.rejected: list[bool] = []
        self._request_dict = {HEADER_KEY: "acct:x", HEADER_NONCE: nonce}

    def reject(self, requeue: bool = False) -> None:
        self.rejected.append(requeue)
        self.acknowledged = True


@pytest.mark.parametrize("room", [True, False])
def test_a_published_promotion_is_given_back_once_when_the_pool_has_long_work(
    monkeypatch: pytest.MonkeyPatch, room: bool
) -> None:
    """``Receipt._decline_promotion``: a promotion fetched from the broker by a worker whose every process has
    long work (a free prefetch slot fetches as readily as an idle worker) is requeued for a worker waiting on the
    queue — once: delivered here again, it is kept (no bouncing when every pool is busy). With room it is kept at
    once. Without a nonce (an arrival, or a promotion bound here) nothing is declined."""
    from celery.worker import state as worker_state

    from celery_keyed.worker.receipt import Receipt

    asked: list[object] = []

    def pool_has_room(released: str | None = None, *, exclude: object = None) -> bool:
        asked.append(exclude)
        return room

    readied: list[object] = []
    monkeypatch.setattr(worker_state, "task_ready", readied.append)
    gate = SimpleNamespace(
        closed=False, stopping=threading.Event(), handoff=SimpleNamespace(pool_has_room=pool_has_room), _declined={}
    )
    decline = Receipt._decline_promotion.__get__(gate)
    first = _Promotion("6a1f0000-0000-4000-8000-000000000001")
    assert decline(first) is (not room)
    assert asked == [first]  # the promotion itself is not counted as work that will run here
    assert first.rejected == ([] if room else [True]) and readied == ([] if room else [first])
    again = _Promotion("6a1f0000-0000-4000-8000-000000000001")  # the same promotion delivered here again
    assert decline(again) is False and again.rejected == []
    for nonce in (None, 7, ["x"]):
        assert decline(_Promotion(nonce)) is False


def test_the_first_keyed_arrival_asks_every_pinned_thread_to_warm_up_once() -> None:
    from celery_keyed.gate import GateService

    asked: list[str] = []
    gate = SimpleNamespace(
        _warm_requested=False,
        admission=SimpleNamespace(request_warm=lambda: asked.append("admission")),
        receipts=SimpleNamespace(request_warm=lambda: asked.append("receipt")),
        releaser=SimpleNamespace(request_warm=lambda: asked.append("releaser")),
    )
    GateService._warm_services(gate)  # type: ignore[arg-type]
    GateService._warm_services(gate)  # type: ignore[arg-type]
    assert asked == ["admission", "receipt", "releaser"]


def test_a_request_of_a_key_at_the_receipt_service_is_handed_on_after_it_in_order() -> None:
    """``Receipt._pass_job``: while a request of a key is at the receipt service (a park, or a claim taken
    ahead), a later request of that key — one key, or a list of keys that names it — goes there too, to be handed on
    after it with no ledger call (D10); its keys count until the loop acts on it (``_received``). Any other request,
    and a hostile key header, goes straight on."""
    from celery_keyed.headers import HEADER_KEY
    from celery_keyed.worker.receipt import Receipt

    submitted: list[Any] = []
    gate = SimpleNamespace(
        generation=3,
        _at_receipt={"acct:1": 1},
        receipts=SimpleNamespace(submit=lambda job: submitted.append(job) or True),
        stopping=threading.Event(),
        closed=False,
    )
    handed: list[str] = []
    for header in ("acct:9", {"x": 1}, None, ["other:2"]):
        request = SimpleNamespace(_request_dict={HEADER_KEY: header})
        assert Receipt._pass_job(gate, request, handed.append) is None  # type: ignore[arg-type]
    several = SimpleNamespace(id="m", _request_dict={HEADER_KEY: ["acct:1", "other:2", 7]}, keyed_receipt=False)
    job = Receipt._pass_job(gate, several, lambda r: handed.append(r.id))  # type: ignore[arg-type]
    assert job is not None and job.extra["pass"] and job.extra["keys"] == ["acct:1", "other:2"]
    assert Receipt._submit_receipt(gate, job)  # type: ignore[arg-type]
    assert gate._at_receipt == {"acct:1": 2, "other:2": 1}
    Receipt._received(gate, job)  # type: ignore[arg-type]
    assert handed == ["m"] and gate._at_receipt == {"acct:1": 1}


def test_requests_that_hold_a_slot_wait_first_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """``join_line``: in the line for a pool process, the requests that hold a slot (promotions started here, claims
    taken ahead) wait ahead of those that hold none, in the order they joined. Newest first, a key whose release had
    just bound its next attempt here kept the process that freed, release after release, while the slots held by the
    other keys' promotions and claims waited (peers W4: the last keys ran alone at the end). A request sent back
    undecided (``Receipt._back_in_line``) goes behind those that hold a slot, ahead of the others."""
    from celery_keyed.worker.handoff import _HandoffConsumer, join_line

    gate, semaphore, _ = _waiting_gate(monkeypatch, held=set())
    consumer = gate.consumer
    promotions = _HandoffConsumer(consumer, None)

    def order() -> list[str]:
        return [entry[1][0].id for entry in semaphore._waiting]

    consumer.on_task_request(_Request("plain1", "a"))  # holds nothing
    join_line(consumer, semaphore._waiting[-1][1][0])
    assert order() == ["plain1"]
    ahead = _Request("ahead", "b")
    ahead.keyed_slot_held = True  # a claim taken ahead (Receipt._received)
    consumer.on_task_request(ahead)
    join_line(consumer, ahead)
    promotions.on_task_request(_Request("p1", "c"))
    promotions.on_task_request(_Request("p2", "d"))
    plain2 = _Request("plain2", "e")
    consumer.on_task_request(plain2)
    join_line(consumer, plain2)
    assert order() == ["ahead", "p1", "p2", "plain1", "plain2"]
    gate._returned = 0
    gate._back_in_line(_Request("back1", "f"))
    gate._back_in_line(_Request("back2", "g"))
    assert order() == ["ahead", "p1", "p2", "back1", "back2", "plain1", "plain2"]
    promotions.on_task_request(_Request("p3", "h"))
    assert order() == ["ahead", "p1", "p2", "p3", "back1", "back2", "plain1", "plain2"]


def test_a_release_is_handed_over_even_if_fitting_the_prefetch_window_fails() -> None:
    """``Finish.release``: the prefetch window is refitted after the release is handed to the releaser, and a
    fault there is logged; it never keeps a slot from going back."""
    import os

    from celery_keyed.worker.finish import Finish
    from celery_keyed.worker.running import Running

    handed: list[Any] = []
    gate: Any = Finish.__new__(Finish)
    gate.lock = threading.Lock()
    gate.pid = os.getpid()
    gate.running = {}
    gate.releasing = 0
    gate.handoff = SimpleNamespace(note_run=lambda seconds: None)
    gate.releaser = SimpleNamespace(
        hand_over=lambda token, fence, outcome, **kw: handed.append((token, outcome)), is_contended=lambda key: False
    )

    def broken() -> None:
        raise RuntimeError("no QoS")

    gate.fit_prefetch = broken
    request = SimpleNamespace(
        name="t", keyed_claim=(Token("a", 0), 7), keyed_arrival_key="k", keyed_cancelled=None,
        task=SimpleNamespace(uncertain_hold=None),
    )
    gate.running[Token("a", 0)] = Running(request, Token("a", 0), 7)
    gate.release(request, Outcome.COMPLETED)
    assert handed == [(Token("a", 0), Outcome.COMPLETED)] and gate.releasing == 0


class CountingEvent(threading.Event):
    """An Event that counts its ``set`` calls (each one wakes a waiting thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def _piped_handoff() -> tuple[Any, dict[int, Any]]:
    """A handoff attached to a stand-in hub that records its readers: {fd: callback}."""
    gate = SimpleNamespace(releaser=None, timers=[], closed=False)
    handoff = handoff_of(gate)
    handoff.breaker = SimpleNamespace(sync_keyed_queues=lambda: None)
    readers: dict[int, Any] = {}
    hub = SimpleNamespace(add_reader=readers.__setitem__, remove_reader=lambda fd: readers.pop(fd, None))
    handoff.attach(hub)
    return handoff, readers


def test_no_work_handed_to_the_loop_is_left_unrun_when_wakeups_are_shared() -> None:
    """Two threads hand calls to a loop thread that runs them whenever the pipe is readable: every call runs (one
    handed over while a wakeup was pending, and not seen by the drain that wakeup caused, would be left)."""
    import select
    import time

    handoff, readers = _piped_handoff()
    read_fd = handoff._waker[1]
    ran: list[int] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            if select.select([read_fd], [], [], 0.01)[0]:
                readers[read_fd]()

    looper = threading.Thread(target=loop)
    looper.start()
    try:
        def many(base: int) -> None:
            for n in range(base, base + 2000):
                handoff.defer(lambda n=n: ran.append(n))

        other = threading.Thread(target=many, args=(10_000,))
        other.start()
        many(0)
        other.join()
        deadline = time.monotonic() + 10
        while len(ran) < 4000:
            assert time.monotonic() < deadline, f"{4000 - len(ran)} calls were left unrun"
            time.sleep(0.01)
    finally:
        stop.set()
        looper.join()
        handoff.close()
    assert sorted(ran) == list(range(2000)) + list(range(10_000, 12_000))


def test_no_release_is_left_behind_by_a_releaser_that_is_woken_only_when_it_must_be() -> None:
    """Releases handed over from two threads as fast as they can, to a thread that lingers briefly and takes small
    batches: every one is given back, in order per hand-over thread (a release that did not wake the lingering
    thread and was then left in the queue with the thread asleep would fail the wait)."""
    gate = fake_gate()
    releaser = releaser_of(gate, linger=0.0005, batch=7)  # type: ignore[arg-type]
    releaser.start()
    try:
        def many(prefix: str) -> None:
            for n in range(1500):
                hand(releaser, f"{prefix}{n}")

        other = threading.Thread(target=many, args=("b",))
        other.start()
        many("a")
        other.join()
        _wait_idle(releaser)
    finally:
        releaser.stop()
    released = [task_id for call in gate.ledger.calls for task_id in call[1]]
    assert sorted(released) == sorted([f"a{n}" for n in range(1500)] + [f"b{n}" for n in range(1500)])
    for prefix in "ab":
        mine = [int(t[1:]) for t in released if t[0] == prefix]
        assert mine == sorted(mine)


def test_a_lingering_releaser_is_woken_only_by_a_release_that_ends_its_wait() -> None:
    """While the releaser thread lingers, a release of a key without a line leaves it asleep (a wakeup per release
    costs the loop's process a thread switch and the interpreter's lock for nothing); a release of a contended key
    or a full batch wakes it, and everything goes in one call."""
    import time

    gate = fake_gate()
    releaser = releaser_of(gate, linger=30.0, batch=5)  # type: ignore[arg-type]
    ready = releaser._ready = CountingEvent()
    releaser.start()
    try:
        hand(releaser, "r0")  # wakes the idle thread, which then lingers
        deadline = time.monotonic() + 10
        while not releaser._lingering:
            assert time.monotonic() < deadline, "the releaser did not linger"
            time.sleep(0.005)
        woken = ready.sets
        hand(releaser, "r1")
        hand(releaser, "r2")
        assert ready.sets == woken  # nothing to decide yet: still asleep
        releaser.hand_over(Token("c", 0), 1, Outcome.COMPLETED, key="k:2", name="t", contended=True)
        assert ready.sets == woken + 1
        _wait_idle(releaser)
        assert gate.ledger.calls == [("release_many", ["r0", "r1", "r2", "c"])]
        for n in range(3, 8):  # the fifth fills a batch: it wakes the lingering thread
            hand(releaser, f"r{n}")
        _wait_idle(releaser)
        assert gate.ledger.calls[-1] == ("release_many", [f"r{n}" for n in range(3, 8)])
    finally:
        releaser.stop()
