"""A key that throttles itself (issue 14 item 4) on real Postgres: a key's own pause and limit (keyed_key_overrides,
migration 0014) are honoured by every path that claims a slot, lowering never preempts, waiters keep their places
and start when a pause ends (the sweep wakes them), a paused name pauses every key, both expire by themselves (the
claim compares them with its own time), every change is audited, and a pause racing a claim on real row locks
never lets the claim start after the pause committed. The books balance."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import (
    EXCLUSIVE_COST,
    Arrival,
    InvalidConfig,
    InvalidKey,
    Ledger,
    NameConfig,
    Outcome,
    ReleaseRequest,
    Token,
    Verdict,
    admit,
    key_overrides_live,
    status_keys,
    status_names,
)
from celery_keyed.ledger.reconcile import check_counters_once
from tests.integration.test_races import Side, wait_until_blocked


def used(scalar: Callable[..., object], key: str) -> int:
    return int(scalar("SELECT COALESCE(sum(used), 0) FROM keyed_slots WHERE key = :key", key=key) or 0)


def claims_of(scalar: Callable[..., object], key: str) -> set[str]:
    rows = scalar("SELECT string_agg(task_id, ',' ORDER BY task_id) FROM keyed_claims WHERE key = :key", key=key)
    return set(str(rows).split(",")) if rows else set()


def log(scalar: Callable[..., object]) -> str:
    return str(
        scalar(
            "SELECT string_agg(coalesce(key, '-') || ' ' || action || ' ' || coalesce(old_limit::text, '-') || '>'"
            " || coalesce(new_limit::text, '-'), ', ' ORDER BY id) FROM keyed_override_log"
        )
    )


def test_a_paused_key_starts_nothing_new_while_other_keys_of_its_name_run(ledger: Ledger, scalar, clock) -> None:
    ledger.configure({"api": NameConfig("api", limit=2)}, now=clock())
    a = ledger.admit(Arrival("a", key="api:1"), now=clock())
    until, changed = ledger.pause_key("api:1", 30, reason="429 Retry-After 30", author="task t[a]", now=clock())
    assert changed and until == clock() + timedelta(seconds=30)
    assert claims_of(scalar, "api:1") == {"a"}  # the running task goes on: a pause never preempts
    assert ledger.admit(Arrival("b", key="api:1", message={"id": "b"}), now=clock()).verdict is Verdict.PARKED
    assert ledger.admit(Arrival("c", key="api:1", message={"id": "c"}), now=clock()).verdict is Verdict.PARKED
    assert ledger.admit(Arrival("x", key="api:2"), now=clock()).admitted  # another key of the name runs
    assert ledger.admit(Arrival("y", key="api:2"), now=clock()).admitted
    # a's release makes room, but the key is paused: nothing is promoted, by the release nor by the sweep.
    assert ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock()).promotions == []
    assert ledger.sweep(now=clock.advance(29)).promotions == []
    assert used(scalar, "api:1") == 0
    # The pause ends: the sweep wakes the line, in order, as many as the limit allows (2).
    promoted = ledger.sweep(now=clock.advance(2)).promotions
    assert [p.task_id for p in promoted] == ["b", "c"]
    assert ledger.key_override("api:1", now=clock()) is None
    assert log(scalar) == "api:1 pause ->0, api:1 resume 0>-"
    assert check_counters_once(ledger.engine) == []


def test_every_claim_path_honours_a_key_pause(ledger: Ledger, scalar, clock) -> None:
    """The fast claim (CLAIM_NEW, CLAIM_NEW_MULTI), the batch (keyed_claim_many), the plain path and park at receipt
    (keyed_admit_or_park_plain), a retry's fast claim (SLOTS_CLAIM_ANY), the general path (an exclusive attempt:
    FITS), release-and-promote (keyed_promote_plain), a name override raised (promote_name) and the sweep: none starts
    anything of a paused key."""
    now = clock()
    ledger.configure({"api": NameConfig("api", limit=3), "other": NameConfig("other", limit=3)}, now=now)
    first = ledger.admit(Arrival("first", key="api:1"), now=now)  # slot rows exist: the fast paths can run
    retry = ledger.admit(Arrival("r", key="api:1"), now=now)
    ledger.release(Token("r", 0), retry.fence, Outcome.RETRY, now=now)
    ledger.pause_key("api:1", 60, reason="429", now=now)
    verdicts = {
        "fast": ledger.admit(Arrival("fast", key="api:1", message={}), now=now).verdict,
        "multi": ledger.admit(Arrival("multi", key="api:1", extra_keys=("other:1",), message={}), now=now).verdict,
        "retry": ledger.admit(Arrival("r", attempt=1, key="api:1", cost=2, message={}), now=now).verdict,
        "writer": ledger.admit(Arrival("w", key="api:1", cost=EXCLUSIVE_COST, message={}), now=now).verdict,
        "receipt": getattr(ledger.park_at_receipt(Arrival("rc", key="api:1", message={}), now=now), "verdict", None),
    }
    batch = ledger.admit_many([Arrival(f"b{i}", key="api:1", message={}) for i in range(2)], now=now)
    assert verdicts == dict.fromkeys(verdicts, Verdict.PARKED)
    assert [a.verdict for a in batch] == [Verdict.PARKED, Verdict.PARKED]
    assert claims_of(scalar, "api:1") == {"first"}
    (report,) = ledger.release_many(
        [ReleaseRequest(Token("first", 0), first.fence, Outcome.COMPLETED)], now=now
    )
    assert report.released and report.promotions == []
    assert ledger.set_override("api", 5, reason="raise the name", now=now) == []
    assert ledger.sweep(now=now).promotions == []
    assert used(scalar, "api:1") == 0 and used(scalar, "other:1") == 0
    # Resumed: the line starts in its order (FIFO, D10), 5 at a time (the name's override).
    promoted = ledger.resume_key("api:1", reason="vendor says ok", now=now)
    assert promoted is not None
    assert [p.task_id for p in promoted] == ["fast", "multi", "r"]  # the writer waits for an idle key, first in line
    assert ledger.books()["arrivals"] == 8


def test_a_key_limit_replaces_its_names_for_that_key_only(ledger: Ledger, scalar) -> None:
    ledger.configure({"api": NameConfig("api", limit=1)})
    ledger.set_key_limit("api:big", 3, reason="enterprise tenant", author="ops")
    assert [ledger.admit(Arrival(f"b{i}", key="api:big", message={})).verdict for i in range(4)] == [
        Verdict.ADMITTED] * 3 + [Verdict.PARKED]
    assert [ledger.admit(Arrival(f"s{i}", key="api:small", message={})).verdict for i in range(2)] == [
        Verdict.ADMITTED, Verdict.PARKED]
    with ledger.engine.connect() as conn:
        names = {n.name: n for n in status_names(conn)}
        keys = {k.key: k for k in status_keys(conn, name="api")}
    assert names["api"].limited_keys == 1 and names["api"].paused_keys == 0
    assert (keys["api:big"].limit, keys["api:big"].source) == (3, "key")
    assert (keys["api:small"].limit, keys["api:small"].source) == (1, "config")


def test_lowering_a_key_limit_never_preempts_and_raising_promotes_at_once(ledger: Ledger, scalar) -> None:
    ledger.set_key_limit("m:1", 3, reason="vendor header: 3")  # unconfigured name: K = 1 otherwise
    running = {t: ledger.admit(Arrival(t, key="m:1", message={})) for t in "abc"}
    assert all(a.admitted for a in running.values())
    assert ledger.set_key_limit("m:1", 1, reason="vendor header: 1") == []
    assert claims_of(scalar, "m:1") == {"a", "b", "c"}  # nobody preempted
    assert ledger.admit(Arrival("d", key="m:1", message={})).verdict is Verdict.PARKED
    assert ledger.release(Token("a", 0), running["a"].fence, Outcome.COMPLETED).promotions == []  # 2 in flight > 1
    assert ledger.release(Token("b", 0), running["b"].fence, Outcome.COMPLETED).promotions == []  # 1 in flight = 1
    assert ledger.admit(Arrival("e", key="m:1", message={})).verdict is Verdict.PARKED
    assert [p.task_id for p in ledger.set_key_limit("m:1", 3, reason="vendor header: 3")] == ["d", "e"]
    promoted = ledger.clear_key_limit("m:1", reason="back to the name's")
    assert promoted == []  # 3 in flight, the name's K = 1: nothing more starts
    assert ledger.clear_key_limit("m:1") is None  # nothing to clear
    assert log(scalar) == "m:1 set ->3, m:1 set 3>1, m:1 set 1>3, m:1 clear 3>-"


def test_a_paused_name_pauses_every_key_whatever_its_own_limit(ledger: Ledger) -> None:
    ledger.set_key_limit("g:1", 5, reason="raised")
    ledger.set_override("g", 0, reason="incident")
    assert ledger.admit(Arrival("a", key="g:1", message={})).verdict is Verdict.PARKED
    assert [p.task_id for p in ledger.clear_override("g", reason="over")] == ["a"]


def test_a_key_limit_and_a_pause_expire_by_themselves(ledger: Ledger, scalar, clock) -> None:
    ledger.set_key_limit("g:1", 2, reason="for a minute", expires_in=60, now=clock())
    assert ledger.admit(Arrival("a", key="g:1"), now=clock()).admitted
    assert ledger.admit(Arrival("b", key="g:1"), now=clock()).admitted
    # Past its expiry the claim itself reads the name's limit (1): no sweep needed for correctness.
    assert ledger.admit(Arrival("c", key="g:2"), now=clock.advance(61)).admitted
    assert ledger.admit(Arrival("d", key="g:1", message={}), now=clock()).verdict is Verdict.PARKED
    ledger.pause_key("g:3", 10, reason="short", now=clock())
    assert ledger.admit(Arrival("e", key="g:3", message={}), now=clock()).verdict is Verdict.PARKED
    # Past the pause's end the next arrival finds room: the line's head (e) starts first, it waits (FIFO).
    after = ledger.admit(Arrival("f", key="g:3", message={}), now=clock.advance(11))
    assert after.verdict is Verdict.PARKED and [p.task_id for p in after.promotions] == ["e"]
    ledger.sweep(now=clock())  # clears both, logs both
    assert scalar("SELECT count(*) FROM keyed_key_overrides") == 0
    assert log(scalar) == "g:1 set ->2, g:3 pause ->0, g:1 expire 2>-, g:3 resume 0>-"
    lapses = "SELECT string_agg(reason || '/' || author, ',' ORDER BY id) FROM keyed_override_log WHERE id > 2"
    assert scalar(lapses) == "expired/,pause ended/"  # the sweep's rows: no author


def test_a_pause_is_only_ever_extended(ledger: Ledger, scalar, clock) -> None:
    long, set_long = ledger.pause_key("k:1", 60, reason="Retry-After 60", now=clock())
    short, set_short = ledger.pause_key("k:1", 5, reason="Retry-After 5", now=clock())
    assert set_long and not set_short and short == long
    later, extended = ledger.pause_key("k:1", 90, reason="Retry-After 90", now=clock())
    assert extended and later > long
    assert scalar("SELECT count(*) FROM keyed_override_log WHERE action = 'pause'") == 2
    assert ledger.resume_key("k:1", reason="ok") == []
    assert ledger.resume_key("k:1") is None


def test_a_task_repeating_its_vendors_header_writes_one_audit_row(ledger: Ledger, scalar, clock) -> None:
    for _ in range(5):
        ledger.set_key_limit("api:1", 4, reason="X-Concurrency-Limit: 4", expires_in=60, now=clock.advance(1))
    assert scalar("SELECT count(*) FROM keyed_override_log") == 1
    own = ledger.key_override("api:1", now=clock())
    assert own is not None and own.slot_limit == 4 and own.expires_at == clock() + timedelta(seconds=60)


def test_key_override_validation(ledger: Ledger, engine: sa.Engine) -> None:
    with pytest.raises(InvalidKey):
        ledger.pause_key("bad key", 5, reason="x")
    with pytest.raises(InvalidConfig, match="non-negative integer"):
        ledger.set_key_limit("g:1", -1, reason="x")
    with pytest.raises(InvalidConfig, match="needs a reason"):
        ledger.pause_key("g:1", 5, reason=" ")
    with pytest.raises(InvalidConfig, match="seconds"):
        ledger.pause_key("g:1", 0, reason="x")
    with pytest.raises(InvalidConfig, match="one of the two"):
        ledger.pause_key("g:1", reason="x")
    with pytest.raises(sa.exc.IntegrityError, match="keyed_key_overrides_name_of_key"), engine.begin() as c:
        c.execute(sa.text("INSERT INTO keyed_key_overrides (key, name) VALUES ('g:1', 'h')"))
    with pytest.raises(sa.exc.IntegrityError, match="keyed_key_overrides_limit_reason"), engine.begin() as c:
        c.execute(sa.text("INSERT INTO keyed_key_overrides (key, name, slot_limit) VALUES ('g:1', 'g', 1)"))


def test_explain_and_status_show_a_keys_pause(ledger: Ledger, clock) -> None:
    ledger.admit(Arrival("a", key="api:1"), now=clock())
    ledger.pause_key("api:1", 30, reason="429 from the vendor", author="task call[a]", now=clock())
    ledger.admit(Arrival("b", key="api:1", message={}), now=clock())
    why = ledger.explain("b", now=clock())
    assert why.state == "paused"
    assert "key api:1 is paused until" in why.text and "429 from the vendor by task call[a]" in why.text
    assert why.facts["key_override"]["paused"] is True
    with ledger.engine.connect() as conn:
        (own,) = key_overrides_live(conn, now=clock())
        keys = {k.key: k for k in status_keys(conn, now=clock())}
        names = {n.name: n for n in status_names(conn, now=clock())}
    assert own.key == "api:1" and own.effective_limit == 0 and own.pause_reason == "429 from the vendor"
    assert keys["api:1"].source == "key_paused" and keys["api:1"].limit == 0
    assert names["api"].paused_keys == 1


# -- races on real row locks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["fast", "batch", "plain"])
def test_a_claim_racing_a_pause_never_starts_after_the_pause_committed(engine: sa.Engine, path: str) -> None:
    """The pause holds the key's slot rows (rewritten under its lock) when the claim arrives; the claim waits for
    them. Once the pause commits, the claim re-checks its guard against it (keyed_key_limit reads with a fresh
    snapshot): it parks. Without the rewrite (or with a limit read from the claim's older snapshot) it was admitted
    after the pause had committed."""
    ledger = Ledger(engine, holder="race:1:aaaa", lease=30.0)
    ledger.configure({"api": NameConfig("api", limit=2)})
    warm = ledger.admit(Arrival("warm", key="api:1"))  # the key's slot row exists; one slot of two is free
    pausing = engine.connect()
    tx = pausing.begin()
    from celery_keyed.ledger.key_overrides import pause_key

    pause_key(pausing, "api:1", 60, reason="429")
    arrival = Arrival("late", key="api:1", message={"id": "late"})

    def claim(conn: sa.Connection) -> object:
        if path == "batch":
            return admit.claim_many(conn, [arrival], holder="race:1:aaaa", lease=30.0)[0][0]
        if path == "plain":
            return admit.admit_plain(conn, arrival, holder="race:1:aaaa", lease=30.0)[0]
        return admit.admit_autocommit(conn, arrival, holder="race:1:aaaa", lease=30.0)[0]

    side = Side(engine, claim)
    side.start()
    wait_until_blocked(engine, side)
    tx.commit()
    pausing.close()
    result = side.finish()
    assert getattr(result, "verdict", None) is not Verdict.ADMITTED
    with engine.connect() as conn:
        held = conn.execute(sa.text("SELECT string_agg(task_id, ',') FROM keyed_claims")).scalar()
    assert held == "warm"
    ledger.release(Token("warm", 0), warm.fence, Outcome.COMPLETED)
    assert check_counters_once(engine) == []


def test_the_bound_holds_while_tasks_throttle_their_key(engine: sa.Engine) -> None:
    """Four threads claim and release on one key (name limit 5) while another sets the key's limit between 1 and 2
    and pauses it now and then: at every claim, the claims that exist for the key never exceed 2 (what the key ever
    allowed), and none is admitted while the key is paused; at the end nothing is held and the books balance."""
    ledger = Ledger(engine, holder="race:1:aaaa", lease=30.0)
    ledger.configure({"api": NameConfig("api", limit=5)})
    ledger.set_key_limit("api:1", 2, reason="start")
    stop = threading.Event()
    errors: list[str] = []
    counter = iter(range(10**6))
    lock = threading.Lock()

    def drain(promotions: list) -> None:
        """Run every promoted attempt at once, as its worker would: bind it, then finish it."""
        for p in promotions:
            fence = ledger.bind(Token(p.task_id, p.attempt), p.nonce)
            if fence is not None:
                drain(ledger.release(Token(p.task_id, p.attempt), fence, Outcome.COMPLETED).promotions)

    def worker() -> None:
        while not stop.is_set():
            with lock:
                task_id = f"t{next(counter)}"
            adm = ledger.admit(Arrival(task_id, key="api:1", message={"id": task_id}))
            if not adm.admitted:
                drain(ledger.revoke(task_id))
                continue
            with engine.connect() as conn:
                held = conn.execute(sa.text("SELECT count(*) FROM keyed_claims WHERE key = 'api:1'")).scalar_one()
            if held > 2:
                errors.append(f"{held} claims of api:1 with a key limit of at most 2")
            drain(ledger.release(Token(task_id, 0), adm.fence, Outcome.COMPLETED).promotions)

    def operator() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            ledger.set_key_limit("api:1", 1 + n % 2, reason=f"header {n % 2}")
            if n % 5 == 0:
                ledger.pause_key("api:1", 0.05, reason="429")

    threads = [threading.Thread(target=worker) for _ in range(4)] + [threading.Thread(target=operator)]
    for t in threads:
        t.start()
    stop.wait(3.0)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    drain(ledger.sweep().promotions)
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT task_id FROM keyed_waiting")).scalars().all()
    for task_id in left:
        drain(ledger.revoke(task_id))
    assert check_counters_once(engine) == []
    books = ledger.books()
    assert "open" not in books and books["arrivals"] == books.get("completed", 0) + books.get("revoked", 0) > 0


def test_metrics_count_paused_and_limited_keys_per_name(database_url: str, ledger: Ledger) -> None:
    """The gauges celery_keyed_keys_paused / celery_keyed_keys_own_limit, per name (never a series per key)."""
    from prometheus_client import CollectorRegistry

    from celery_keyed.metrics import LedgerCollector

    ledger.pause_key("api:1", 60, reason="429")
    ledger.pause_key("api:2", 60, reason="429")
    ledger.set_key_limit("api:3", 4, reason="header")
    ledger.set_key_limit("crm:1", 2, reason="header", expires_in=60)
    registry = CollectorRegistry()
    collector = LedgerCollector(database_url, timeout=1.0)
    registry.register(collector)
    try:
        value = registry.get_sample_value
        assert value("celery_keyed_keys_paused", {"name": "api"}) == 2
        assert value("celery_keyed_keys_own_limit", {"name": "api"}) == 1
        assert value("celery_keyed_keys_paused", {"name": "crm"}) == 0
        assert value("celery_keyed_keys_own_limit", {"name": "crm"}) == 1
    finally:
        collector.engine.dispose()
