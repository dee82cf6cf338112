"""Release-and-promote in one call (issue 12 item 2; migration 0007, ``keyed_release_and_promote``).

A release that frees a slot of a plain key (no group, not uncertain, not a lost worker) with waiters is ONE
self-committing server-side call: no BEGIN / COMMIT, no second call, whether the caller said ``contended`` or not — so
the freed slot is never visible to anyone else between the release and the promotion. Before 0007 it was
``keyed_release_many`` then ``keyed_promote_plain``: four round trips in one transaction with ``contended``, two
transactions without. The guards stay those of D1/D2/D4/D5/D10: FIFO by priority then arrival, the bound, a promotion
bound to the releasing holder when it runs it itself (no nonce), else a nonce and a dispatch deadline; a release racing
an admission of the same key never strands a waiter next to a free slot nor lets the newcomer pass the line.

Round trips are counted at the driver: every statement a cursor sends and every command psycopg sends on its own
(BEGIN, COMMIT, ROLLBACK), in the calling thread.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg._connection_base import BaseConnection

from celery_keyed.ledger import (
    Arrival,
    Ledger,
    NameConfig,
    Outcome,
    ReleaseRequest,
    Token,
    Verdict,
    admit,
    check_counters_once,
    release,
)
from tests.integration.test_batches import NoRetry, parked, touch, used, wait_for_lock_waiter
from tests.integration.test_races import count

HOLDER = "release-promote:1:aaaa"
LOCAL = {"local_queues": ["q"], "local_tasks": ["proj.sync"]}
MESSAGE = {"task": "proj.sync"}


@pytest.fixture
def ledger(engine: sa.Engine) -> Ledger:
    return NoRetry(engine, holder=HOLDER, lease=30.0, dispatch=10.0)


@contextmanager
def round_trips(engine: sa.Engine) -> Iterator[list[str]]:
    """What this thread sends to the server and waits for, in order: statements (named by the ledger function they
    call, else their first word) and psycopg's own commands (BEGIN, COMMIT, ROLLBACK)."""
    sent: list[str] = []
    me = threading.get_ident()

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.get_ident() == me:
            called = re.search(r"\b(keyed_\w+)\s*\(", statement)
            sent.append(called.group(1) if called else statement.split()[0].upper())

    original = BaseConnection._exec_command

    def exec_command(self: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == me:
            text = command.decode() if isinstance(command, bytes) else str(command)
            sent.append(text.split()[0].upper())
        return original(self, command, *args, **kwargs)

    sa.event.listen(engine, "before_cursor_execute", record)
    BaseConnection._exec_command = exec_command  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        BaseConnection._exec_command = original  # type: ignore[method-assign]
        sa.event.remove(engine, "before_cursor_execute", record)


def hold(ledger: Ledger, task_id: str, key: str) -> int:
    got = ledger.admit(Arrival(task_id, key=key))
    assert got.verdict is Verdict.ADMITTED and got.fence is not None, got
    return got.fence


def park(ledger: Ledger, task_id: str, key: str, *, priority: int = 0, queue: str = "q") -> None:
    got = ledger.admit(Arrival(task_id, key=key, priority=priority, queue=queue, message=MESSAGE))
    assert got.verdict is Verdict.PARKED, got


class Thread(threading.Thread):
    """Run ``work()`` on a thread of its own, counting its round trips."""

    def __init__(self, engine: sa.Engine, work: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.work = work
        self.sent: list[str] = []
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with round_trips(self.engine) as sent:
                self.result = self.work()
            self.sent = sent
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> Any:
        self.join(timeout=30)
        assert not self.is_alive(), "the thread never finished"
        if self.error is not None:
            raise self.error
        return self.result


# -- one round trip ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("local", [True, False], ids=["local", "nonce"])
@pytest.mark.parametrize("contended", [False, True], ids=["uncontended", "contended"])
def test_release_that_promotes_is_one_round_trip(
    engine: sa.Engine, ledger: Ledger, contended: bool, local: bool
) -> None:
    """Fails before 0007: [keyed_release_many, BEGIN, keyed_promote_plain, COMMIT] (either order of BEGIN)."""
    touch(ledger, ["acct:1"])
    fence = hold(ledger, "h", "acct:1")
    park(ledger, "p", "acct:1")
    with round_trips(engine) as sent:
        report = ledger.release(
            Token("h", 0), fence, Outcome.COMPLETED, contended=contended, **(LOCAL if local else {})
        )
    assert sent == ["keyed_release_and_promote"], sent
    assert report.released and report.finished == [("h", "completed")]
    assert [p.task_id for p in report.promotions] == ["p"]
    assert used(engine, "acct:1") == 1 and parked(engine, "acct:1") == []
    assert count(engine, "SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 0


def test_release_without_waiters_is_still_one_round_trip(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:1"])
    fence = hold(ledger, "h", "acct:1")
    with round_trips(engine) as sent:
        report = ledger.release(Token("h", 0), fence, Outcome.COMPLETED)
    assert sent == ["keyed_release_and_promote"], sent
    assert report.released and report.promotions == []


def test_a_batch_where_some_releases_promote_and_others_do_not(engine: sa.Engine, ledger: Ledger) -> None:
    """One call for the whole batch; each promotion is reported by the request that gave back a room on its key."""
    keys = ["acct:1", "acct:2", "acct:3", "acct:4"]
    touch(ledger, keys)
    fences = [hold(ledger, f"h{i}", key) for i, key in enumerate(keys, start=1)]
    park(ledger, "w1", "acct:1")
    park(ledger, "w3", "acct:3")
    park(ledger, "w3b", "acct:3")
    requests = [
        ReleaseRequest(Token(f"h{i}", 0), fence, Outcome.COMPLETED) for i, fence in enumerate(fences, start=1)
    ]
    requests[1] = ReleaseRequest(Token("h2", 0), fences[1], Outcome.RETRY)  # the attempt is over, the task goes on
    requests[3] = ReleaseRequest(Token("h4", 0), fences[3] + 1000, Outcome.COMPLETED)  # stale fence: nothing
    with round_trips(engine) as sent:
        reports = ledger.release_many(requests)
    # h4's stale fence is decided again by the general path (as before 0007): one transaction that finds nothing.
    assert sent[0] == "keyed_release_and_promote" and "keyed_release_and_promote" not in sent[1:], sent
    assert "keyed_promote_plain" not in sent and "keyed_release_many" not in sent
    assert [r.released for r in reports] == [True, True, True, False]
    assert [[p.task_id for p in r.promotions] for r in reports] == [["w1"], [], ["w3"], []]
    assert [r.finished for r in reports] == [[("h1", "completed")], [], [("h3", "completed")], []]
    assert [used(engine, k) for k in keys] == [1, 0, 1, 1]
    assert parked(engine, "acct:3") == ["w3b"]
    assert check_counters_once(engine) == []  # no drift


def test_a_batch_promotes_in_fifo_order_priority_then_arrival(engine: sa.Engine, ledger: Ledger) -> None:
    """Two slots freed in one call go to the two first of the line (D10: priority, then arrival), in that order."""
    ledger.configure({"gate": NameConfig("gate", limit=2)})
    touch(ledger, ["gate:x"])
    fences = [hold(ledger, "h1", "gate:x"), hold(ledger, "h2", "gate:x")]
    park(ledger, "first", "gate:x")
    park(ledger, "second", "gate:x")
    park(ledger, "urgent", "gate:x", priority=5)
    park(ledger, "third", "gate:x")
    with round_trips(engine) as sent:
        reports = ledger.release_many(
            [ReleaseRequest(Token(f"h{i}", 0), f, Outcome.COMPLETED) for i, f in enumerate(fences, start=1)]
        )
    assert sent == ["keyed_release_and_promote"], sent
    # Both rooms are on one key: the first request that gave one back reports both promotions.
    assert [[p.task_id for p in r.promotions] for r in reports] == [["urgent", "first"], []]
    assert parked(engine, "gate:x") == ["second", "third"]
    assert used(engine, "gate:x") == 2
    # The line keeps its order through single releases too.
    order = []
    promotion = reports[0].promotions[0]
    for _ in range(2):
        assert promotion.nonce is not None
        fence = ledger.bind(promotion.token, promotion.nonce)
        assert fence is not None
        promotion = ledger.release(promotion.token, fence, Outcome.COMPLETED).promotions[0]
        order.append(promotion.task_id)
    assert order == ["second", "third"]


# -- local handoff (D4) or a nonce (D5) ---------------------------------------------------------------------------


def test_local_promotion_is_this_holders_running_claim(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:1"])
    fence = hold(ledger, "h", "acct:1")
    park(ledger, "p", "acct:1")
    promotion = ledger.release(Token("h", 0), fence, Outcome.COMPLETED, **LOCAL).promotions[0]
    assert promotion.nonce is None and promotion.message == MESSAGE and promotion.queue == "q"
    row = _claim(engine, "p")
    assert (row.state, row.holder, row.nonce, row.fence) == ("running", HOLDER, None, promotion.fence)
    assert row.parked is not None  # the stored message stays with the claim: a lost run goes back in line
    assert row.lease_left == pytest.approx(30.0, abs=5.0)


def test_a_promotion_the_releaser_does_not_run_carries_a_nonce_and_a_deadline(
    engine: sa.Engine, ledger: Ledger
) -> None:
    touch(ledger, ["acct:1", "acct:2"])
    fences = [hold(ledger, "h1", "acct:1"), hold(ledger, "h2", "acct:2")]
    park(ledger, "other-queue", "acct:1", queue="elsewhere")
    park(ledger, "p", "acct:2")
    reports = [
        ledger.release(Token("h1", 0), fences[0], Outcome.COMPLETED, **LOCAL),  # not a queue it consumes
        ledger.release(Token("h2", 0), fences[1], Outcome.COMPLETED),  # no local handoff asked
    ]
    for report, task_id in zip(reports, ["other-queue", "p"], strict=True):
        (promotion,) = report.promotions
        assert promotion.task_id == task_id and promotion.nonce is not None
        row = _claim(engine, task_id)
        assert (row.state, row.holder, row.nonce) == ("promoted", None, promotion.nonce)
        assert row.deadline_left == pytest.approx(10.0, abs=5.0)  # the ledger's dispatch timeout (D5)
        assert ledger.bind(promotion.token, promotion.nonce) == promotion.fence


def test_local_handoff_in_a_batch_one_run_per_request_with_a_room(engine: sa.Engine, ledger: Ledger) -> None:
    ledger.configure({"gate": NameConfig("gate", limit=2)})
    touch(ledger, ["gate:x"])
    fences = [hold(ledger, "h1", "gate:x"), hold(ledger, "h2", "gate:x")]
    for name in ["w1", "w2"]:
        park(ledger, name, "gate:x")
    requests = [
        ReleaseRequest(Token(f"h{i}", 0), f, Outcome.COMPLETED, local_queues={"q"}, local_tasks={"proj.sync"})
        for i, f in enumerate(fences, start=1)
    ]
    # Both rooms are given back on one key and reported at the first request: one request with a room, one local run.
    promotions = [p for r in ledger.release_many(requests) for p in r.promotions]
    assert [(p.task_id, p.nonce is None) for p in promotions] == [("w1", True), ("w2", False)]


def test_local_handoff_in_a_batch_needs_one_set_for_every_room(engine: sa.Engine, ledger: Ledger) -> None:
    """Requests with rooms naming different local sets (or one naming none): every promotion carries a nonce."""
    touch(ledger, ["acct:1", "acct:2", "acct:3", "acct:4"])
    fences = [hold(ledger, f"h{i}", f"acct:{i}") for i in range(1, 5)]
    for i in range(1, 5):
        park(ledger, f"w{i}", f"acct:{i}")
    same = {"local_queues": frozenset({"q"}), "local_tasks": frozenset({"proj.sync"})}
    other = {"local_queues": frozenset({"q", "r"}), "local_tasks": frozenset({"proj.sync"})}
    mixed = ledger.release_many(
        [
            ReleaseRequest(Token("h1", 0), fences[0], Outcome.COMPLETED, **same),
            ReleaseRequest(Token("h2", 0), fences[1], Outcome.COMPLETED, **other),
        ]
    )
    assert all(p.nonce is not None for r in mixed for p in r.promotions)
    one_set = ledger.release_many(
        [
            ReleaseRequest(Token("h3", 0), fences[2], Outcome.COMPLETED, **same),
            ReleaseRequest(Token("h4", 0), fences[3], Outcome.COMPLETED, **same),
        ]
    )
    assert [[(p.task_id, p.nonce is None) for p in r.promotions] for r in one_set] == [
        [("w3", True)],
        [("w4", True)],
    ]


# -- what the call leaves to the general path ------------------------------------------------------------------------


@pytest.mark.parametrize("contended", [False, True], ids=["uncontended", "contended"])
def test_a_head_that_is_not_plain_is_promoted_right_after(engine: sa.Engine, ledger: Ledger, contended: bool) -> None:
    """keyed_release_and_promote stops a line at a head with a group (kind 'general'); one more transaction promotes
    it into the room the call reported (FIFO: the grouped head first), locally when asked."""
    touch(ledger, ["acct:1"])
    fence = hold(ledger, "h", "acct:1")
    got = ledger.admit(Arrival("g", key="acct:1", group_key="order:1", queue="q", message=MESSAGE))
    assert got.verdict is Verdict.PARKED
    park(ledger, "p", "acct:1")
    with round_trips(engine) as sent:
        report = ledger.release(Token("h", 0), fence, Outcome.COMPLETED, contended=contended, **LOCAL)
    # The call, then one transaction for the grouped head (before 0007 with `contended`: the same transaction).
    assert sent[0] == "keyed_release_and_promote" and "BEGIN" in sent and sent[-1] == "COMMIT", sent
    assert [(p.task_id, p.group_key, p.nonce is None) for p in report.promotions] == [("g", "order:1", True)]
    assert parked(engine, "acct:1") == ["p"] and used(engine, "acct:1") == 1
    assert check_counters_once(engine) == []


def test_a_released_attempts_shadow_is_dropped_and_its_room_promoted(engine: sa.Engine, ledger: Ledger) -> None:
    touch(ledger, ["acct:1"])
    fence = hold(ledger, "h", "acct:1")
    copy = ledger.admit(Arrival("h", key="acct:1"))  # a second delivery of the running attempt: its shadow (D8)
    assert copy.verdict is not Verdict.ADMITTED
    assert count(engine, "SELECT count(*) FROM keyed_waiting WHERE task_id = 'h' AND shadow") == 1
    park(ledger, "p", "acct:1")
    report = ledger.release(Token("h", 0), fence, Outcome.COMPLETED)
    assert [p.task_id for p in report.promotions] == ["p"]
    assert count(engine, "SELECT count(*) FROM keyed_waiting") == 0
    assert count(engine, "SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 0
    assert used(engine, "acct:1") == 1


# -- races on real row locks ---------------------------------------------------------------------------------------


def test_a_release_waiting_for_a_park_of_its_key_promotes_the_parked_in_its_one_call(
    engine: sa.Engine, ledger: Ledger
) -> None:
    """The admission holds the key's slot row while it parks; the release waits for the row, then reads the waiters
    in a later statement of its one call (D2) and promotes the parked attempt — no waiter stranded, one round trip."""
    touch(ledger, ["acct:1"])
    fence = hold(ledger, "h", "acct:1")
    with engine.connect() as conn, conn.begin():
        arrival = Arrival("p", key="acct:1", queue="q", message=MESSAGE)
        assert admit.admit(conn, arrival, holder=HOLDER, lease=30.0).verdict is Verdict.PARKED
        releaser = Thread(engine, lambda: ledger.release(Token("h", 0), fence, Outcome.COMPLETED, **LOCAL))
        releaser.start()
        wait_for_lock_waiter(engine)
    report = releaser.finish()
    assert releaser.sent == ["keyed_release_and_promote"], releaser.sent
    assert [(p.task_id, p.nonce) for p in report.promotions] == [("p", None)]  # run by the releaser (D4)
    assert used(engine, "acct:1") == 1 and parked(engine, "acct:1") == []
    assert check_counters_once(engine) == []


def test_an_arrival_waiting_for_a_release_of_its_key_does_not_pass_the_promoted(
    engine: sa.Engine, ledger: Ledger
) -> None:
    """The release-and-promote holds the key's slot row (its one call, here inside a transaction kept open); an
    arrival of the same key waits for the row and, once the call commits, finds the freed slot taken by the head of
    the line (D10): it parks behind, never over the bound."""
    touch(ledger, ["acct:1"])
    fence = hold(ledger, "h", "acct:1")
    park(ledger, "p", "acct:1")
    with engine.connect() as conn, conn.begin():
        request = ReleaseRequest(Token("h", 0), fence, Outcome.COMPLETED)
        done = release.release_and_promote(conn, [request], holder=HOLDER, lease=30.0, dispatch=10.0)
        assert [p.task_id for p in done.promotions] == ["p"]
        arrival = Thread(engine, lambda: ledger.admit(Arrival("x", key="acct:1")))
        arrival.start()
        wait_for_lock_waiter(engine)
    assert arrival.finish().verdict is Verdict.PARKED
    assert used(engine, "acct:1") == 1 and parked(engine, "acct:1") == ["x"]
    assert count(engine, "SELECT state FROM keyed_claims WHERE task_id = 'p'") == "promoted"
    assert check_counters_once(engine) == []


def test_releases_racing_admissions_of_one_key_keep_the_bound_and_strand_no_one(
    engine: sa.Engine, ledger: Ledger
) -> None:
    """Threads: admissions and releases of one mutex key interleaved on real locks. Every arrival runs exactly once,
    in the order of the line, never two at once, and nothing is left parked. And no arrival ever finds the slot a
    release freed still free with a line waiting (it would start the line's head itself, ``Admission.promotions``):
    the release promoted it in the same call. Before 0007 the uncontended release committed the freed slot before
    its promotion's transaction, and arrivals met it there."""
    touch(ledger, ["acct:1"])
    n = 30
    lock = threading.Lock()
    running: list[tuple[Token, int]] = []
    started: list[str] = []
    by_arrivals: list[str] = []
    errors: list[BaseException] = []
    arrived = threading.Event()

    def start(promotions: Any) -> None:
        for promotion in promotions:
            assert promotion.nonce is not None
            bound = ledger.bind(promotion.token, promotion.nonce)
            assert bound is not None
            with lock:
                running.append((promotion.token, bound))
                started.append(promotion.task_id)

    def arrive() -> None:
        try:
            for i in range(n):
                got = ledger.admit(Arrival(f"a{i}", key="acct:1"))
                by_arrivals.extend(p.task_id for p in got.promotions)
                start(got.promotions)
                if got.verdict is Verdict.ADMITTED:
                    assert got.fence is not None
                    with lock:
                        running.append((Token(f"a{i}", 0), got.fence))
                        started.append(f"a{i}")
                else:
                    assert got.verdict is Verdict.PARKED, got
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            arrived.set()

    def finish() -> None:
        try:
            done, idle = 0, 0
            while done < n and not errors and idle < 5000:
                with lock:
                    job = running.pop(0) if running else None
                if job is None:
                    idle += arrived.is_set()
                    threading.Event().wait(0.001)
                    continue
                idle = 0
                token, fence = job
                report = ledger.release(token, fence, Outcome.COMPLETED)
                assert report.released
                done += 1
                start(report.promotions)
                assert count(engine, "SELECT used FROM keyed_slots WHERE key = 'acct:1'") <= 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=arrive), threading.Thread(target=finish)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert started == [f"a{i}" for i in range(n)]  # each exactly once, in the order of the line (D10)
    assert used(engine, "acct:1") == 0 and parked(engine, "acct:1") == []
    assert check_counters_once(engine) == []
    assert ledger.books()["completed"] == n + 1  # and the touch
    assert by_arrivals == [], "an arrival found a freed slot before the release's promotion"


def _claim(engine: sa.Engine, task_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT state, holder, nonce, fence, parked,"
                " extract(epoch FROM lease_expires_at - now())::float8 AS lease_left,"
                " extract(epoch FROM dispatch_deadline - now())::float8 AS deadline_left"
                " FROM keyed_claims WHERE task_id = :t"
            ),
            {"t": task_id},
        ).one()


@pytest.mark.parametrize("waiting", [False, True])
def test_a_release_reaches_its_rows_by_primary_key_however_many_keys_exist(
    engine: sa.Engine, database_url: str, waiting: bool
) -> None:
    """keyed_release_many runs with generic plans (0013). Migration 0018: its give-back, its waiter check and its room
    read reach the rows of the keys it released by primary key — never a scan of keyed_slots or keyed_keys, whose cost
    grows with every key the ledger knows (before 0018 the generic plan of its join against the released (key, shard)
    pairs was a sequential scan of both tables). Read from the plans of the statements inside the function
    (auto_explain, nested statements), on a ledger of 3,000 keys."""
    with engine.connect() as conn:
        try:
            conn.execute(sa.text("LOAD 'auto_explain'"))
        except sa.exc.OperationalError as exc:  # psycopg's UndefinedFile: the pgserver wheel's build has no contrib
            if "auto_explain" not in str(exc) or (os.environ.get("CI") and not os.environ.get("KEYED_PG_BINDIR")):
                raise
            pytest.skip(f"this PostgreSQL has no auto_explain ({os.environ.get('KEYED_PG_BINDIR')})")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO keyed_slots (key, shard, name, used) SELECT 'acct:' || g, 0, 'acct', 0"
                " FROM generate_series(1, 3000) g"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO keyed_keys (key, name, waiting, active_at) SELECT 'acct:' || g, 'acct', 0, now()"
                " FROM generate_series(1, 3000) g"
            )
        )
        conn.execute(sa.text("ANALYZE keyed_slots"))
        conn.execute(sa.text("ANALYZE keyed_keys"))
    plans: list[str] = []
    explained = sa.create_engine(database_url, pool_size=1, max_overflow=0)

    @sa.event.listens_for(explained, "connect")
    def _explain(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
        with dbapi_connection.cursor() as cursor:
            for setting in (
                "LOAD 'auto_explain'",
                "SET auto_explain.log_min_duration = 0",
                "SET auto_explain.log_nested_statements = on",
                "SET auto_explain.log_level = 'notice'",
            ):
                cursor.execute(setting)
        dbapi_connection.commit()

    try:
        ledger = Ledger(explained, holder=HOLDER, lease=30.0, dispatch=10.0)
        for round_ in range(8):  # past the point where a plan cache would switch to its generic plan
            held = ledger.admit(Arrival(f"h{round_}", key="acct:7"))
            assert held.verdict is Verdict.ADMITTED and held.fence is not None
            if waiting:
                assert ledger.admit(Arrival(f"w{round_}", key="acct:7")).verdict is Verdict.PARKED
            plans.clear()
            report = ledger.release(Token(f"h{round_}", 0), held.fence, Outcome.COMPLETED)
            assert report.released
            if waiting:
                (promotion,) = report.promotions
                assert promotion.nonce is not None
                fence = ledger.bind(promotion.token, promotion.nonce)
                assert fence is not None
                assert ledger.release(promotion.token, fence, Outcome.COMPLETED).released
        inside = [p for p in plans if "keyed_slots" in p or "keyed_keys" in p]
        assert inside, plans  # the statements inside the function were explained
        scans = [p for p in inside if re.search(r"Seq Scan on keyed_(slots|keys)\b", p)]
        assert not scans, scans[0]
    finally:
        explained.dispose()
