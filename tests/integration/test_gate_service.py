"""The gate service's background duties on real Postgres, driven directly (no worker): releasing claims of
requests that were admitted but never started (D6), and noticing a reclaimed slot (D7)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_keyed.gate import GateService, Running
from celery_keyed.ledger import Arrival, Token
from celery_keyed.settings import read_settings


@pytest.fixture
def gate(database_url: str):
    app = Celery("gate-test", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_lease = 2.0
    consumer = SimpleNamespace(hostname="gate-test", timer=None, strategies={}, pool=None)
    service = GateService(app, consumer, read_settings(app.conf))
    yield service
    service.engine.dispose()


def _track(gate: GateService, task_id: str, key: str, *, started: bool, age: float) -> SimpleNamespace:
    admission = gate.ledger.admit(Arrival(task_id, key=key))
    token = Token(task_id, 0)
    request = SimpleNamespace(
        name="t", keyed_started=started, keyed_claim=(token, admission.fence), keyed_arrival_key=key
    )
    gate.running[token] = Running(request, token, admission.fence, claimed_at=time.monotonic() - age)
    return request


def test_a_claim_admitted_but_never_started_is_released(gate: GateService, engine: sa.Engine) -> None:
    dropped = _track(gate, "dropped", "k:1", started=False, age=5.0)  # the consumer reset forgot it
    young = _track(gate, "young", "k:2", started=False, age=0.0)  # just admitted: may still start
    running = _track(gate, "running", "k:3", started=True, age=5.0)
    gate.heartbeat_once()
    with engine.connect() as conn:
        held = set(conn.execute(sa.text("SELECT task_id FROM keyed_claims")).scalars())
        open_tasks = set(conn.execute(sa.text("SELECT task_id FROM keyed_tasks WHERE outcome IS NULL")).scalars())
    assert held == {"young", "running"}
    assert dropped.keyed_claim is None and young.keyed_claim is not None and running.keyed_claim is not None
    assert "dropped" in open_tasks  # worker lost, not finished: its redelivery will be admitted again


def test_a_reclaimed_slot_is_noticed_and_no_longer_tracked(gate: GateService, engine: sa.Engine) -> None:
    request = _track(gate, "lost", "k:1", started=True, age=0.0)
    with engine.begin() as conn:  # the reaper took it (the lease lapsed while this worker was stalled)
        conn.execute(sa.text("DELETE FROM keyed_claims WHERE task_id = 'lost'"))
    gate.heartbeat_once()
    assert request.keyed_claim is None
    assert Token("lost", 0) not in gate.running


def test_a_release_on_the_releaser_thread_hands_its_local_promotion_to_the_woken_loop(database_url: str) -> None:
    """The releaser thread commits the release; the promotion bound to this worker (D4) is started on the
    consumer loop (a real kombu hub, run by a thread of this test), woken at once through the pipe: the only
    timer that would also drain it is 60 s away."""
    import base64
    import threading

    from kombu.asynchronous import Hub

    from celery_keyed.ledger import Outcome, Verdict

    app = Celery("gate-test", broker="memory://", set_as_current=False)
    app.conf.update(keyed_database_url=database_url, keyed_lease=2.0, keyed_probe_interval=60.0)
    hub = Hub()
    started = threading.Event()
    seen: dict[str, object] = {}

    def strategy(message, body, ack, reject, callbacks) -> None:  # stands in for Celery's task strategy
        seen.update(thread=threading.get_ident(), task_id=message.headers["id"])
        started.set()

    queue = SimpleNamespace(name="celery", routing_key="celery")
    consumer = SimpleNamespace(
        hostname="gate-test",
        timer=hub.timer,
        hub=hub,
        strategies={"t": strategy},
        pool=None,
        task_consumer=SimpleNamespace(queues=[queue]),
    )
    gate = GateService(app, consumer, read_settings(app.conf))

    def record(task_id: str) -> dict[str, object]:
        return {
            "task": "t",
            "body": base64.b64encode(b"[[], {}, {}]").decode("ascii"),
            "content_type": "application/json",
            "content_encoding": "utf-8",
            "headers": {"id": task_id, "task": "t"},
            "properties": {},
            "exchange": "",
            "routing_key": "celery",
        }

    first = gate.ledger.admit(Arrival("first", key="k:1", task_name="t", queue="celery", message=record("first")))
    parked = gate.ledger.admit(Arrival("next", key="k:1", task_name="t", queue="celery", message=record("next")))
    assert first.verdict is Verdict.ADMITTED and parked.verdict is Verdict.PARKED

    stop = threading.Event()

    def run_loop() -> None:
        loop = hub.create_loop()
        while not stop.is_set():
            next(loop)

    gate.start()
    loop_thread = threading.Thread(target=run_loop, daemon=True)
    loop_thread.start()
    try:
        request = SimpleNamespace(name="t", keyed_claim=(Token("first", 0), first.fence), keyed_arrival_key="k:1")
        gate.release(request, Outcome.COMPLETED)
        assert started.wait(10), "the promotion did not reach the loop"
        assert seen == {"thread": loop_thread.ident, "task_id": "next"}
        assert Token("next", 0) in gate.handoff.prebound  # bound to this worker in the promotion's transaction
        with gate.engine.connect() as conn:
            claims = conn.execute(sa.text("SELECT task_id, holder FROM keyed_claims")).all()
        assert [(c.task_id, c.holder) for c in claims] == [("next", gate.ledger.holder)]
    finally:
        stop.set()
        gate.handoff.wake_loop()
        loop_thread.join(timeout=5)
        gate.close()
        hub.close()


def test_a_local_promotion_celery_discards_as_revoked_gives_its_slot_back(database_url: str) -> None:
    """A promotion bound to this worker (D4) whose task was revoked meanwhile: Celery's strategy discards it at
    receipt (here: a strategy that drops it, as Celery's does for an id in its revoked list), so the gate gives
    the slot back as revoked instead of leaving a bound claim nobody runs (it would lapse and go back in line)."""
    import base64

    from celery.worker import state as worker_state

    from celery_keyed.ledger import Outcome, Verdict

    app = Celery("gate-test", broker="memory://", set_as_current=False)
    app.conf.update(keyed_database_url=database_url, keyed_lease=2.0)
    queue = SimpleNamespace(name="celery", routing_key="celery")
    consumer = SimpleNamespace(
        hostname="gate-test",
        timer=None,
        strategies={"t": lambda *args: None},  # discards every message, like Celery's for a revoked id
        pool=None,
        task_consumer=SimpleNamespace(queues=[queue]),
    )
    gate = GateService(app, consumer, read_settings(app.conf))

    def record(task_id: str) -> dict[str, object]:
        body = base64.b64encode(b"[[], {}, {}]").decode("ascii")
        return {
            "task": "t",
            "body": body,
            "content_type": "application/json",
            "content_encoding": "utf-8",
            "headers": {"id": task_id, "task": "t"},
            "properties": {},
            "exchange": "",
            "routing_key": "celery",
        }

    first = gate.ledger.admit(Arrival("first", key="k:1", task_name="t", queue="celery", message=record("first")))
    parked = gate.ledger.admit(Arrival("gone", key="k:1", task_name="t", queue="celery", message=record("gone")))
    assert first.verdict is Verdict.ADMITTED and parked.verdict is Verdict.PARKED
    worker_state.revoked.add("gone")
    try:
        request = SimpleNamespace(name="t", keyed_claim=(Token("first", 0), first.fence), keyed_arrival_key="k:1")
        gate.release(request, Outcome.COMPLETED)  # not started: runs here, and runs the promotion here (D4)
        with gate.engine.connect() as conn:
            claims = conn.execute(sa.text("SELECT count(*) FROM keyed_claims")).scalar()
            used = conn.execute(sa.text("SELECT coalesce(sum(used), 0) FROM keyed_slots")).scalar()
            outcome = conn.execute(sa.text("SELECT outcome FROM keyed_tasks WHERE task_id = 'gone'")).scalar()
        assert (claims, used, outcome) == (0, 0, "revoked")
        assert Token("gone", 0) not in gate.handoff.prebound
    finally:
        worker_state.revoked.discard("gone")
        gate.close()


def _stored(task_id: str) -> dict[str, object]:
    import base64

    return {
        "task": "t",
        "body": base64.b64encode(b"[[], {}, {}]").decode("ascii"),
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": {"id": task_id, "task": "t"},
        "properties": {},
        "exchange": "",
        "routing_key": "celery",
    }


def _received(task_id: str, key: str) -> SimpleNamespace:
    """A received request as the gate reads it (the header path of ``intake.arrival_for``)."""
    from kombu.message import Message

    from celery_keyed.headers import HEADER_KEY

    headers = {"id": task_id, "task": "t", HEADER_KEY: key}
    message = Message(
        body=b"[[], {}, {}]",
        content_type="application/json",
        content_encoding="utf-8",
        headers=headers,
        delivery_info={"exchange": "", "routing_key": "celery"},
    )
    return SimpleNamespace(
        id=task_id,
        name="t",
        task=SimpleNamespace(per_call_keys=True),  # the header decides: a task that takes per-call keys
        _request_dict=dict(headers),
        delivery_info={"routing_key": "celery"},
        _expires=None,
        _message=message,
        keyed_claim=None,
        keyed_started=False,
        keyed_arrival_key=None,
    )


def test_a_promotion_bound_by_this_workers_release_starts_without_a_round_trip_while_its_lease_must_hold(
    database_url: str,
) -> None:
    """D14 for a local handoff (D4): the promotion the release bound to this worker starts with no statement
    while its claim provably cannot have lapsed (``Handoff.take_fresh``: less than a lease minus the self-fence
    margin after the release call began); an older one is bound by the guarded statement (``Ledger.confirm``)."""
    from celery_keyed.ledger import Outcome, Verdict

    app = Celery("gate-test", broker="memory://", set_as_current=False)
    app.conf.update(keyed_database_url=database_url, keyed_lease=30.0)
    queue = SimpleNamespace(name="celery", routing_key="celery")
    consumer = SimpleNamespace(
        hostname="gate-test",
        timer=None,
        strategies={"t": lambda *args: None},  # the restored request reaches the pool later (below, by hand)
        pool=None,
        task_consumer=SimpleNamespace(queues=[queue]),
    )
    gate = GateService(app, consumer, read_settings(app.conf))
    statements: list[str] = []
    sa.event.listen(gate.engine, "before_cursor_execute", lambda c, cur, stmt, *a: statements.append(stmt))
    try:
        admitted = [
            gate.ledger.admit(Arrival(t, key="k:1", task_name="t", queue="celery", message=_stored(t)))
            for t in ("first", "fresh", "old")
        ]
        assert [a.verdict for a in admitted] == [Verdict.ADMITTED, Verdict.PARKED, Verdict.PARKED]
        first = SimpleNamespace(name="t", keyed_claim=(Token("first", 0), admitted[0].fence), keyed_arrival_key="k:1")
        gate.release(first, Outcome.COMPLETED)  # no releaser thread: runs here and hands "fresh" to us (D4)
        bound = gate.handoff.prebound[Token("fresh", 0)]
        assert bound.granted is not None

        fresh = _received("fresh", "k:1")
        started: list[str] = []
        statements.clear()
        gate.execute(fresh, lambda: started.append("fresh"))
        assert started == ["fresh"] and statements == []  # no round trip on the way to the pool
        assert fresh.keyed_claim == (Token("fresh", 0), bound.fence)
        assert Token("fresh", 0) in gate.running and Token("fresh", 0) not in gate.handoff.prebound

        gate.release(fresh, Outcome.COMPLETED)  # hands "old" to us
        late = gate.handoff.prebound[Token("old", 0)]
        late.granted = time.monotonic() - gate.settings.lease + gate.settings.self_fence_margin  # at the limit
        old = _received("old", "k:1")
        statements.clear()
        gate.execute(old, lambda: started.append("old"))
        assert started == ["fresh", "old"]
        assert any("keyed_claims" in s for s in statements), "an old promotion is bound by a guarded statement"
        assert old.keyed_claim == (Token("old", 0), late.fence)
        with gate.engine.connect() as conn:
            claims = conn.execute(sa.text("SELECT task_id, holder, fence FROM keyed_claims")).all()
        assert [(c.task_id, c.holder, c.fence) for c in claims] == [("old", gate.ledger.holder, late.fence)]
    finally:
        gate.close()


def test_newest_wins_a_cancel_request_reaches_the_attempt_at_the_next_heartbeat(gate: GateService) -> None:
    """Newest wins when the keyed_cancel broadcast was lost: the holder's heartbeat asks the ledger and raises the
    attempt's keyed_cancelled() flag (a pool that cannot terminate: pool=None here); its release records superseded."""
    from celery_keyed.ledger import Ledger, Outcome, Verdict

    def render(task_id: str) -> Arrival:
        return Arrival(task_id, key="doc:1", task_name="t.render", on_newer="cancel_running", message={})

    old = gate.ledger.admit(render("old"))
    token = Token("old", 0)
    request = SimpleNamespace(
        name="t.render", keyed_started=True, keyed_claim=(token, old.fence), keyed_arrival_key="doc:1",
        keyed_cancelled=None, task=SimpleNamespace(on_newer="cancel_running", supersede_key=None, uncertain_hold=None),
        _request_dict={"keyed_key": "doc:1", "keyed_on_newer": "cancel_running"},
    )
    gate.running[token] = Running(request, token, old.fence)
    other_worker = Ledger(gate.engine, holder="other:1:bb", lease=2.0)
    new = other_worker.admit(render("new"))  # the newest waits for the slot (a mutex) and asks the old one to stop
    assert new.verdict is Verdict.PARKED and new.cancels == (("old", 0, gate.ledger.holder),)
    assert not gate.cancelled("old", 0)
    gate.heartbeat_once()
    assert gate.cancelled("old", 0) and request.keyed_cancelled == "superseded by new (newest wins)"
    report = gate.ledger.release(token, old.fence, Outcome.SUPERSEDED, detail=request.keyed_cancelled)
    assert [p.task_id for p in report.promotions] == ["new"]
    assert gate.ledger.books() == {"superseded": 1, "open": 1, "arrivals": 2}


def test_a_revoke_the_ledger_cannot_store_is_dropped_and_the_others_are_stored(
    gate: GateService, engine: sa.Engine
) -> None:
    """A foreign revoke broadcast naming an id the ledger cannot hold (over PostgreSQL's index row size: it used to
    read as the database being down, opening the breaker; a NUL) is logged and dropped: the revokes listed with it
    are stored, the breaker stays closed, nothing is left pending to be retried for ever."""
    import secrets

    gate.ledger.admit(Arrival("running", key="rv:1"))
    gate.ledger.admit(Arrival("parked", key="rv:1", message={"id": "parked"}))
    gate.record_revokes(["t-" + secrets.token_hex(4000), "nul\x00id", "parked", "unseen"])
    assert not gate.breaker.is_open and not gate.revokes.pending
    with engine.connect() as conn:
        outcomes = dict(conn.execute(sa.text("SELECT task_id, outcome FROM keyed_tasks")).all())
        waiting = conn.execute(sa.text("SELECT count(*) FROM keyed_waiting")).scalar()
    assert outcomes == {"running": None, "parked": "revoked", "unseen": "revoked"}
    assert waiting == 0


def test_at_worker_shutdown_claims_of_requests_no_pool_process_took_go_back(
    gate: GateService, engine: sa.Engine
) -> None:
    """A warm shutdown that drops a job handed to the pool before any process took it (its message goes back to the
    broker unacked): Celery sends ``worker_shutdown`` once the pool has stopped, and the claim goes back then, as
    "worker lost", instead of being held by a worker that is gone until its lease lapses. A started attempt keeps
    its claim (its outcome hook releases it). While the pool still runs, nothing is released."""
    from celery import signals

    from celery_keyed import bootstep

    class Worker:  # Celery's WorkController, as the handler reads it (a signal's sender must be hashable)
        def __init__(self, active: bool) -> None:
            self.pool = SimpleNamespace(active=active)

    unstarted = _track(gate, "unstarted", "k:1", started=False, age=5.0)  # older than half a lease
    started = _track(gate, "started", "k:2", started=True, age=0.0)
    worker, other = Worker(active=True), Worker(active=False)
    gate.shutdown()
    # Stopped, the loop reads no "accepted" message of the pool: a job a process took looks never started, so the
    # heartbeat must not release it (its body may be running); the pool's stop decides.
    gate.heartbeat_once()
    assert unstarted.keyed_claim is not None and Token("unstarted", 0) in gate.running
    bootstep._stopped_gates[worker] = [gate]
    signals.worker_shutdown.send(sender=worker)  # its pool not stopped yet
    signals.worker_shutdown.send(sender=other)  # another worker of this process: not its gate
    assert unstarted.keyed_claim is not None and bootstep._stopped_gates[worker] == [gate]
    worker.pool.active = False
    signals.worker_shutdown.send(sender=worker)
    assert worker not in bootstep._stopped_gates
    with engine.connect() as conn:
        held = set(conn.execute(sa.text("SELECT task_id FROM keyed_claims")).scalars())
        outcome = conn.execute(sa.text("SELECT outcome FROM keyed_tasks WHERE task_id = 'unstarted'")).scalar()
    assert held == {"started"} and unstarted.keyed_claim is None and started.keyed_claim is not None
    assert outcome is None  # worker lost, not finished: its redelivery is admitted again
    assert Token("unstarted", 0) not in gate.running and Token("started", 0) in gate.running


def test_a_revoke_of_many_tasks_stores_a_few_on_the_loop_and_the_rest_from_the_heartbeat_in_budgets(
    gate: GateService, engine: sa.Engine
) -> None:
    """One transaction per revoke: a broadcast of thousands would hold the consumer loop for seconds. The first
    ``ON_LOOP`` are stored at once; the heartbeat stores the rest, at most a budget per beat."""
    from celery_keyed.worker import revokes

    gate.ledger.admit(Arrival("running", key="rv:many"))
    ids = [f"p{i}" for i in range(revokes.ON_LOOP + 50)]
    for task_id in ids:
        gate.ledger.admit(Arrival(task_id, key="rv:many", message={"id": task_id}))

    def revoked() -> int:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM keyed_tasks WHERE outcome = 'revoked'")).scalar())

    gate.record_revokes(ids)
    assert revoked() == revokes.ON_LOOP and len(gate.revokes.pending) == 50
    gate.revokes.flush_pending(budget=30)
    assert revoked() == revokes.ON_LOOP + 30 and list(gate.revokes.pending) == ids[revokes.ON_LOOP + 30 :]
    gate.heartbeat_once()  # the heartbeat's own flush
    assert revoked() == len(ids) and not gate.revokes.pending
