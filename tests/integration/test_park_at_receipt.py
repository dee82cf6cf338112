"""Park at receipt (``Ledger.park_at_receipt``, keyed_admit_or_park_plain with p_park_only) on real Postgres: an
arrival of a key with a line or no room is parked the moment the worker receives it; one with room and no line is
left to its admission at pool-ready (D3) and nothing is written; a slot is never taken."""

from __future__ import annotations

import threading

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict


def arrival(task_id: str, key: str = "acct:1", **kw: object) -> Arrival:
    return Arrival(task_id=task_id, key=key, task_name="t", message={"id": task_id}, **kw)  # type: ignore[arg-type]


def test_room_and_no_line_is_left_to_admission_and_writes_nothing(ledger: Ledger, scalar) -> None:
    assert ledger.park_at_receipt(arrival("new-key")) is None  # a key's first use: room
    assert scalar("SELECT count(*) FROM keyed_tasks") == 0
    assert ledger.admit(arrival("a")).verdict is Verdict.ADMITTED
    assert ledger.park_at_receipt(arrival("b", key="acct:2")) is None
    assert scalar("SELECT count(*) FROM keyed_claims") == 1  # only a's: never a slot at receipt
    assert scalar("SELECT count(*) FROM keyed_tasks WHERE task_id = 'b'") == 0
    assert ledger.admit(arrival("b", key="acct:2")).verdict is Verdict.ADMITTED  # the fast path, as usual


def test_no_room_parks_at_receipt_and_the_release_promotes_it(ledger: Ledger, scalar) -> None:
    first = ledger.admit(arrival("a"))
    parked = ledger.park_at_receipt(arrival("b"))
    assert parked is not None and parked.verdict is Verdict.PARKED
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 1
    assert first.fence is not None
    report = ledger.release(Token("a", 0), first.fence, Outcome.COMPLETED)
    assert [p.task_id for p in report.promotions] == ["b"]  # no lost wakeup (D2)


def test_a_line_keeps_its_order_whether_parked_at_receipt_or_at_pool_ready(ledger: Ledger) -> None:
    ledger.configure({"gate": NameConfig("gate", limit=2)})
    running = [ledger.admit(arrival(t, "gate:x")) for t in ("r1", "r2")]
    assert ledger.admit(arrival("w1", "gate:x")).verdict is Verdict.PARKED  # at pool-ready
    assert ledger.park_at_receipt(arrival("w2", "gate:x")).verdict is Verdict.PARKED  # type: ignore[union-attr]
    assert ledger.admit(arrival("w3", "gate:x")).verdict is Verdict.PARKED
    order = []
    for token, admission in zip(("r1", "r2"), running, strict=True):
        assert admission.fence is not None
        order += [p.task_id for p in ledger.release(Token(token, 0), admission.fence, Outcome.COMPLETED).promotions]
    assert order == ["w1", "w2"]  # FIFO by the ledger's order of receipt (D10)


def test_a_line_with_room_is_left_to_the_general_path(ledger: Ledger, engine: sa.Engine, scalar) -> None:
    """Room next to a promotable waiter (an override raised, say): the head of the line must start first — that
    is admission's job (it promotes the head), so at receipt the arrival is left alone, and no slot is taken."""
    a = ledger.admit(arrival("a"))
    assert ledger.admit(arrival("b")).verdict is Verdict.PARKED
    with engine.begin() as conn:  # room appears without a promotion (as a raised limit would leave it)
        conn.execute(sa.text("UPDATE keyed_slots SET used = 0 WHERE key = 'acct:1'"))
        conn.execute(sa.text("DELETE FROM keyed_claims WHERE task_id = 'a'"))
    assert a.verdict is Verdict.ADMITTED
    assert ledger.park_at_receipt(arrival("c")) is None
    assert scalar("SELECT coalesce(sum(used), 0) FROM keyed_slots WHERE key = 'acct:1'") == 0


def test_a_full_waiting_room_is_a_recorded_rejection_at_receipt(ledger: Ledger, scalar) -> None:
    ledger.configure({"small": NameConfig("small", limit=1, max_waiting=1)})
    ledger.admit(arrival("a", "small:1"))
    assert ledger.park_at_receipt(arrival("b", "small:1")).verdict is Verdict.PARKED  # type: ignore[union-attr]
    refused = ledger.park_at_receipt(arrival("c", "small:1"))
    assert refused is not None and refused.verdict is Verdict.REJECTED
    assert scalar("SELECT outcome FROM keyed_tasks WHERE task_id = 'c'") == "rejected"


def test_not_plain_arrivals_are_left_to_admission(ledger: Ledger, scalar) -> None:
    ledger.admit(arrival("a"))
    assert ledger.park_at_receipt(arrival("g", group_key="order:1")) is None
    assert ledger.park_at_receipt(arrival("m", extra_keys=("region:1",))) is None
    assert scalar("SELECT count(*) FROM keyed_tasks") == 1


def test_parks_at_receipt_racing_releases_lose_no_wakeup_and_never_exceed_the_bound(
    engine: sa.Engine, scalar
) -> None:
    """Threads park arrivals at receipt and admit / release others of the same key at once: every parked
    attempt is eventually promoted by some release (D2), and at no time does the key hold more than K = 1."""
    ledger = Ledger(engine, holder="race:1:aaaa", lease=30.0, dispatch=10.0)
    errors: list[BaseException] = []
    peak = [0]

    parked: set[str] = set()
    # One attempt parked at receipt before the race, behind a held slot that the runner releases as it starts: the
    # race always has a parked attempt to wake, however the threads are scheduled (on a loaded machine the parkers
    # may all run while the key is idle, and then park nothing).
    held = ledger.admit(arrival("held"))
    seed = ledger.park_at_receipt(arrival("p-seed"))
    assert held.fence is not None and seed is not None and seed.verdict is Verdict.PARKED
    parked.add("p-seed")

    def parker(n: int) -> None:
        try:
            for i in range(25):
                got = ledger.park_at_receipt(arrival(f"p{n}-{i}"))
                if got is not None:
                    assert got.verdict is Verdict.PARKED
                    parked.add(f"p{n}-{i}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def runner() -> None:
        try:
            assert held.fence is not None
            ledger.release(Token("held", 0), held.fence, Outcome.COMPLETED)  # p-seed is promoted: the race begins
            for i in range(40):
                got = ledger.admit(arrival(f"r{i}"))
                used = scalar("SELECT coalesce(sum(used), 0) FROM keyed_slots WHERE key = 'acct:1'")
                peak[0] = max(peak[0], int(used))  # type: ignore[call-overload]
                if got.verdict is Verdict.ADMITTED and got.fence is not None:
                    ledger.release(Token(f"r{i}", 0), got.fence, Outcome.COMPLETED)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=parker, args=(n,)) for n in range(3)] + [threading.Thread(target=runner)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert peak[0] <= 1
    # Drain: complete every promotion in turn; every attempt parked at receipt runs exactly once.
    ran: list[str] = []
    for _ in range(500):
        with engine.connect() as conn:
            claims = conn.execute(sa.text("SELECT task_id, attempt, fence, nonce FROM keyed_claims")).all()
        if not claims:
            break
        assert len(claims) == 1
        c = claims[0]
        ran.append(c.task_id)
        token = Token(c.task_id, c.attempt)
        fence = c.fence if c.nonce is None else ledger.bind(token, c.nonce)  # a promotion is bound first (D5)
        assert fence is not None
        assert ledger.release(token, fence, Outcome.COMPLETED).released
    assert scalar("SELECT count(*) FROM keyed_waiting") == 0
    # Every arrival parked at receipt ran once (those left to admission hold nothing: no claim, no waiting row).
    assert parked and parked <= set(ran) and len(ran) == len(set(ran))
