"""Claims taken ahead at receipt (``keyed_claim_ahead``, issue 13) on real PostgreSQL, with a real gate and its real
receipt service's thread; the consumer and its pool are stand-ins (their size and busy requests are what the gate
counts). A request that will wait for a busy pool process, not long, has its slot claimed while it waits; it starts
with no round trip; the bound, the order of a key's arrivals and the slot's return when nothing starts it hold."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.worker import state as worker_state

from celery_keyed.gate import GateService
from celery_keyed.ledger import Token
from celery_keyed.settings import read_settings
from celery_keyed.worker.admission import AdmissionService
from tests.integration.test_gate_service import _received

TYPICAL_RUN = 0.01  # seconds: the gate's typical run here, so that a request behind one busy process waits ~10 ms


class _Request(SimpleNamespace):
    """A request as Celery's worker state keeps it: in sets, by identity."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__


def _request(task_id: str, key: str) -> Any:
    return _Request(**vars(_received(task_id, key)))


@pytest.fixture
def gate(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[GateService]:
    app = Celery("gate-test", broker="memory://", set_as_current=False)
    app.conf.update(keyed_database_url=database_url, keyed_lease=30.0)
    consumer = SimpleNamespace(hostname="ahead-test", timer=None, strategies={}, pool=SimpleNamespace(num_processes=1))
    service = GateService(app, consumer, read_settings(app.conf))
    service.handoff.typical_run = TYPICAL_RUN
    service.receipts = AdmissionService(service._decide, service._deliver, batch=64, name="keyed-receipt")
    service.receipts.start()
    busy = _Request(id="busy", keyed_claim=None, _request_dict={})  # the one pool process runs it
    monkeypatch.setattr(worker_state, "reserved_requests", {busy})
    monkeypatch.setattr(worker_state, "active_requests", {busy})
    try:
        yield service
    finally:
        service.close()


def _receive(gate: GateService, request: Any, handled: list[str]) -> None:
    """The consumer loop receives ``request`` (reserved, as Celery's strategy leaves it) and hands it on."""
    worker_state.reserved_requests.add(request)
    gate.receive(request, lambda r: handled.append(r.id))


def _loop_turn(gate: GateService, handled: list[str], want: int, timeout: float = 10.0) -> None:
    """Run what the threads handed to the loop until ``want`` requests were handed on."""
    deadline = time.monotonic() + timeout
    while len(handled) < want:
        gate.handoff.run_loop_calls()
        assert time.monotonic() < deadline, f"handed on {handled}, want {want}"
        time.sleep(0.005)


def _claims(engine: sa.Engine) -> dict[str, tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT task_id, holder, fence FROM keyed_claims")).all()
    return {r.task_id: (r.holder, r.fence) for r in rows}


def test_a_request_that_will_wait_for_a_busy_pool_has_its_slot_claimed_and_starts_without_a_round_trip(
    gate: GateService, engine: sa.Engine
) -> None:
    handled: list[str] = []
    first = _request("first", "acct:1")
    _receive(gate, first, handled)
    assert handled == []  # at the receipt service: claimed while it waits
    _loop_turn(gate, handled, 1)
    assert handled == ["first"]
    entry = gate.handoff.prebound[Token("first", 0)]
    assert entry.ahead and entry.granted is not None
    assert _claims(engine) == {"first": (gate.ledger.holder, entry.fence)}  # a claim before any pool process

    statements: list[str] = []
    sa.event.listen(gate.engine, "before_cursor_execute", lambda c, cur, stmt, *a: statements.append(stmt))
    started: list[str] = []
    gate.execute(first, lambda: started.append("first"))  # a pool process is free for it now
    assert started == ["first"] and statements == []  # no round trip on the way to the pool (D14: its lease holds)
    assert first.keyed_claim == (Token("first", 0), entry.fence)
    assert Token("first", 0) in gate.running and Token("first", 0) not in gate.handoff.prebound
    assert not gate.releaser.is_contended("acct:1")  # a claim taken ahead is no line: later arrivals are not parked


def test_arrivals_of_one_key_reach_the_ledger_in_the_order_received_and_the_bound_holds(
    gate: GateService, engine: sa.Engine
) -> None:
    """K = 1: the first arrival's slot is claimed ahead; the second, received while the first is at the receipt
    service, is handed on after it without a ledger call (it must not reach the ledger first: a free pool process
    could take it there before the first's claim, D10); the third waits behind the second, undecided. The second
    parks when a pool process takes it. One claim, never two."""
    handled: list[str] = []
    one, two = _request("one", "acct:7"), _request("two", "acct:7")
    _receive(gate, one, handled)
    _receive(gate, two, handled)
    assert gate._at_receipt == {"acct:7": 2}
    _loop_turn(gate, handled, 2)
    assert handled == ["one", "two"]  # in the order received
    assert gate._at_receipt == {}
    assert set(_claims(engine)) == {"one"}
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM keyed_tasks WHERE task_id = 'two'")).scalar_one() == 0

    three = _request("three", "acct:7")
    _receive(gate, three, handled)
    assert handled == ["one", "two", "three"]  # behind "two", which waits for a process undecided: never before it

    from celery.exceptions import TaskRevokedError

    two.acknowledge = lambda: None
    with pytest.raises(TaskRevokedError):  # a pool process takes "two": no room, parked (its process freed)
        gate.execute(two, lambda: pytest.fail("two must not start while one holds the key"))
    with engine.connect() as conn:
        waiting = conn.execute(sa.text("SELECT task_id FROM keyed_waiting")).scalars().all()
    assert waiting == ["two"]
    assert set(_claims(engine)) == {"one"}  # the bound: one claim on the key


def test_a_claim_taken_ahead_goes_back_when_no_pool_process_takes_it_in_time_or_at_shutdown(
    gate: GateService, engine: sa.Engine
) -> None:
    """Prefetched claims never strand slots: one that no pool process took within a heartbeat interval goes back
    (worker lost: its request, when it starts, is admitted again as a redelivery would be, D8), and the others go
    back when the worker shuts down."""
    from celery_keyed.ledger import Outcome

    handled: list[str] = []
    late, kept = _request("late", "acct:1"), _request("kept", "acct:2")
    _receive(gate, late, handled)
    _receive(gate, kept, handled)
    _loop_turn(gate, handled, 2)
    assert set(_claims(engine)) == {"late", "kept"}
    gate.handoff.prebound[Token("late", 0)].since -= gate.settings.heartbeat_interval
    gate.heartbeat_once()
    deadline = time.monotonic() + 10
    while "late" in _claims(engine):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert Token("late", 0) not in gate.handoff.prebound
    with engine.connect() as conn:
        used = dict(conn.execute(sa.text("SELECT key, sum(used) FROM keyed_slots GROUP BY key")).all())
    assert used["acct:1"] == 0 and used["acct:2"] == 1

    started: list[str] = []
    gate.execute(late, lambda: started.append("late"))  # a process frees at last: admitted again, a new fence
    assert started == ["late"] and late.keyed_claim is not None
    fence = _claims(engine)["late"][1]
    assert late.keyed_claim == (Token("late", 0), fence)
    gate.release(late, Outcome.COMPLETED)

    gate.shutdown()  # "kept" never started: its slot goes back with the worker
    deadline = time.monotonic() + 10
    while _claims(engine):
        assert time.monotonic() < deadline, _claims(engine)
        time.sleep(0.01)


def test_a_claim_taken_ahead_whose_verdict_comes_back_after_a_consumer_restart_goes_back(
    gate: GateService, engine: sa.Engine
) -> None:
    """Celery forgets its reserved requests when the consumer restarts (a broker reconnect) and the broker delivers
    their messages again: a claim taken ahead for one of them is given back, not kept for a request that is gone."""
    handled: list[str] = []
    request = _request("gone", "acct:3")
    gate.receipts.stop()  # decide by hand: the verdict is delivered after the restart below
    gate.receipts._accepting = True
    _receive(gate, request, handled)
    gate.generation += 1  # the consumer restarted meanwhile
    jobs = list(gate.receipts._jobs)
    gate.receipts.admit_once()  # claimed; its verdict reaches the loop (no loop runs here: at once)
    gate.handoff.run_loop_calls()
    assert jobs[0].result[1].verdict.value == "admitted"
    assert handled == [] and Token("gone", 0) not in gate.handoff.prebound
    assert _claims(engine) == {}
    with engine.connect() as conn:
        open_tasks = conn.execute(sa.text("SELECT task_id FROM keyed_tasks WHERE outcome IS NULL")).scalars().all()
    assert open_tasks == ["gone"]  # worker lost, not finished: its redelivery is admitted again


@pytest.mark.parametrize(
    "why",
    [
        "a process is free now",
        "the wait would be long",
        "no typical run yet",
        "the setting is off",
        "a line here",
    ],
)
def test_no_slot_is_claimed_ahead_when_it_gains_nothing_or_could_hold_a_slot_long(
    gate: GateService, engine: sa.Engine, why: str
) -> None:
    """D3 stays the rule outside its one exception: with a free pool process the request goes straight on (its
    admission when the process takes it); behind long work (the expected wait above ``keyed_claim_ahead``: a slot
    held ahead would keep another worker waiting), before any run here was seen, with ``keyed_claim_ahead`` off, or
    when its key has a line here, nothing is claimed."""
    import dataclasses

    if why == "a process is free now":
        worker_state.active_requests.clear()
        worker_state.reserved_requests.clear()
    elif why == "the wait would be long":  # five more requests before it, each a short run: 60 ms
        queued = [_Request(id=f"queued{n}", keyed_claim=None, _request_dict={}) for n in range(5)]
        worker_state.reserved_requests.update(queued)
    elif why == "no typical run yet":
        gate.handoff.typical_run = None
    elif why == "the setting is off":
        gate.settings = dataclasses.replace(gate.settings, claim_ahead=0.0)
    else:
        gate.releaser.mark_contended("acct:1")
    handled: list[str] = []
    request = _request("plain", "acct:1")
    _receive(gate, request, handled)
    if why == "a line here":  # to the receipt service, which finds room and no line: handed on, nothing claimed
        _loop_turn(gate, handled, 1)
    assert handled == ["plain"]
    assert _claims(engine) == {} and not gate.handoff.prebound


def test_a_claim_decided_after_the_worker_stopped_is_given_back_by_the_thread_that_took_it(
    gate: GateService, engine: sa.Engine
) -> None:
    """Under load the receipt thread can outlive the stop's wait for it: its batch is decided after shutdown gave back
    every claim waiting here, and its verdicts go to a loop that no longer runs. A claim it takes then is given back
    at once by that thread (under the lock shutdown's give-back takes), never left in the ledger for nobody to renew
    until its lease lapses."""
    handled: list[str] = []
    request = _request("late", "acct:5")
    gate.receipts.stop()
    gate.receipts._accepting = True  # the thread's last batch, decided by hand below
    _receive(gate, request, handled)
    batch = list(gate.receipts._jobs)  # taken by the thread, which then stalls
    gate.receipts._jobs.clear()
    gate.shutdown()  # stops the consumer, gives back what waits here: nothing yet
    gate._decide(batch)  # ...and now the late thread decides its batch (its verdicts reach no loop)
    assert batch[0].result[1].verdict.value == "admitted"
    assert Token("late", 0) not in gate.handoff.prebound
    assert _claims(engine) == {}
    with engine.connect() as conn:
        open_tasks = conn.execute(sa.text("SELECT task_id FROM keyed_tasks WHERE outcome IS NULL")).scalars().all()
    assert open_tasks == ["late"]  # worker lost: its redelivered message is admitted again


def test_the_prefetch_window_widens_by_what_the_pool_starts_within_the_bound(gate: GateService) -> None:
    """``GateService.fit_prefetch`` on kombu's own QoS: with ``worker_prefetch_multiplier = 1`` a busy pool holds no
    request to claim ahead, so the window is widened by as many messages as the pool is expected to start within
    ``keyed_claim_ahead`` (50 ms): one process frees every typical run / processes; at most one per process. It
    narrows back as runs grow long, while the ledger is unreachable and with the setting off; a consumer restart's
    new QoS starts from Celery's own width."""
    import dataclasses

    from kombu.common import QoS

    applied: list[int] = []
    qos = QoS(lambda prefetch_count: applied.append(prefetch_count), 2)
    gate.consumer.qos = qos
    gate.consumer.pool.num_processes = 2

    def fit(typical: float | None) -> int:
        gate.handoff.typical_run = typical
        gate.fit_prefetch()
        qos.update()  # the consumer loop's next turn
        return qos.value

    assert fit(None) == 2  # no run seen yet
    assert fit(0.002) == 4 and applied[-1] == 4  # short runs: one more message per process, no more
    assert fit(0.05) == 4  # one process frees every 25 ms: two within 50 ms
    assert fit(0.08) == 3  # every 40 ms: one
    assert fit(0.2) == 2  # every 100 ms: none
    assert fit(0.01) == 4
    gate.breaker.is_open = True  # the ledger unreachable: nothing is claimed ahead, nothing held for it
    assert fit(0.01) == 2
    gate.breaker.is_open = False
    assert fit(0.01) == 4

    restarted = QoS(lambda prefetch_count: None, 2)  # a consumer restart: Celery's width again
    gate.consumer.qos = restarted
    gate.consumer._maximum_prefetch_restored = False  # Celery narrowed it after the reconnect and restores it
    gate.fit_prefetch()
    assert restarted.value == 2 and qos.value == 4
    gate.consumer._maximum_prefetch_restored = True
    gate.fit_prefetch()
    assert restarted.value == 4
    gate.settings = dataclasses.replace(gate.settings, claim_ahead=0.0)
    gate.fit_prefetch()
    assert restarted.value == 2
