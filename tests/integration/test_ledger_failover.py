"""A failover of the ledger's server (D20) on a real primary and streaming standby (celery_keyed.testbed_replica): the
first contact with the promoted standby names it, no new claim is taken until one lease has passed, the reaper waits,
and a running attempt whose claim was lost with the primary's last commits takes it back under the slot guard."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Admission, Arrival, Ledger, Outcome, Token, Verdict, migrate
from celery_keyed.ledger.claims import HeldClaim
from celery_keyed.ledger.identity import ClaimHolding, claims_reassert, identity_check, remembered
from celery_keyed.testbed import PostgresServer, find_postgres_bindir, start_postgres
from celery_keyed.testbed_replica import PostgresStandby, crash, multi_host_url, start_standby

pytestmark = pytest.mark.skipif(
    not (find_postgres_bindir() / "pg_basebackup").is_file(), reason="no pg_basebackup beside the test bed's postgres"
)

LEASE = 4.0


@pytest.fixture
def pair() -> Iterator[tuple[PostgresServer, PostgresStandby]]:
    with start_postgres(use_env=False) as primary:
        assert isinstance(primary, PostgresServer)
        engine = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{primary.port}/postgres")
        migrate(engine)
        engine.dispose()
        with start_standby(primary) as standby:
            yield primary, standby


def _admit(ledger: Ledger, task_id: str, key: str) -> Admission:
    return ledger.admit(Arrival(task_id=task_id, key=key, message={"id": task_id}))


def _poll(condition, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def test_a_promoted_standby_holds_new_claims_for_a_lease_and_takes_lost_claims_back(
    pair: tuple[PostgresServer, PostgresStandby], caplog: pytest.LogCaptureFixture
) -> None:
    primary, standby = pair
    engine = sa.create_engine(multi_host_url([primary, standby], "postgres"), pool_pre_ping=True)
    ledger = Ledger(engine, holder="host:1:aaaa", lease=LEASE)
    try:
        kept = _admit(ledger, "kept", "acct:1")  # replicated: survives the failover
        standby.wait_caught_up()
        standby.detach()  # from now on the standby lags: what follows is lost with the primary
        lost = _admit(ledger, "lost", "acct:2")
        with engine.connect() as conn:  # what the worker's failover watch remembers of the claim it holds
            assert lost.fence is not None
            holding = ClaimHolding("lost", 0, lost.fence, "acct:2", 0, 1, "acct", composite=False)
            assert conn.scalar(sa.text("SELECT count(*) FROM keyed_claims WHERE task_id = 'lost'")) == 1
        crash(primary)
        standby.promote()
        engine.dispose()

        changes = remembered(engine).changes
        with caplog.at_level(logging.ERROR, logger="celery_keyed"), engine.begin() as conn:
            check = identity_check(conn, lease=LEASE)  # a new connection: its first contact detected it already
        assert remembered(engine).changes == changes + 1
        assert "ledger failover: a standby was promoted" in caplog.text
        assert check.hold_until is not None
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT count(*) FROM keyed_events WHERE kind = 'failover'")) == 1
            assert conn.scalar(sa.text("SELECT count(*) FROM keyed_claims WHERE task_id = 'lost'")) == 0

        # no new start while the old primary's claims may live: refused by the ledger's trigger, as unavailable
        with pytest.raises(sa.exc.OperationalError, match="no new start"):
            _admit(ledger, "new", "acct:3")
        # the reaper waits too: the surviving claim's lease lapsed on the standby, its worker renews it first
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE keyed_claims SET lease_expires_at = now() - interval '1 hour'"))
        assert ledger.reconcile().reclaimed == []
        assert ledger.renew([HeldClaim("kept", 0, kept.fence)]) == {HeldClaim("kept", 0, kept.fence)}

        # the running attempt whose claim was lost takes it back, with its fence, under the slot guard
        with engine.begin() as conn:
            assert claims_reassert(conn, holding, holder=ledger.holder, task_name="t", lease=LEASE) == "reasserted"
        with engine.begin() as conn:  # a second copy of the same claim is the same claim
            assert claims_reassert(conn, holding, holder=ledger.holder, task_name="t", lease=LEASE) == "kept"
        other = ClaimHolding("other", 0, lost.fence + 1, "acct:2", 0, 1, "acct", composite=False)
        with engine.begin() as conn:  # acct:2 is a mutex and its slot is taken: refused
            assert claims_reassert(conn, other, holder="host:2:bbbb", task_name="t", lease=LEASE) == "refused"
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT used FROM keyed_slots WHERE key = 'acct:2'")) == 1
            assert conn.scalar(sa.text("SELECT count(*) FROM keyed_tasks WHERE task_id = 'lost'")) == 1
        # its outcome has books
        assert ledger.release(Token("lost", 0), lost.fence, Outcome.COMPLETED).released

        # one lease after the failover's detection, new starts are admitted again
        def admitted() -> bool:
            try:
                return _admit(ledger, "new", "acct:3").verdict is Verdict.ADMITTED
            except sa.exc.OperationalError:
                return False

        _poll(admitted)
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT now() >= hold_until FROM keyed_ledger_identity"))
    finally:
        engine.dispose()


def test_a_server_that_kept_its_identity_holds_nothing(pair: tuple[PostgresServer, PostgresStandby]) -> None:
    primary, standby = pair
    engine = sa.create_engine(multi_host_url([primary, standby], "postgres"))
    ledger = Ledger(engine, holder="host:1:aaaa", lease=LEASE)
    try:
        for i in range(3):
            assert _admit(ledger, f"t{i}", f"acct:{i}").verdict is Verdict.ADMITTED
            engine.dispose()  # each a new connection, each a first contact
        with psycopg.connect(primary.conninfo) as conn:
            assert conn.execute("SELECT count(*) FROM keyed_events WHERE kind = 'failover'").fetchone() == (0,)
            assert conn.execute("SELECT hold_until FROM keyed_ledger_identity").fetchone() == (None,)
    finally:
        engine.dispose()


def test_a_restart_of_the_same_server_holds_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """A restart keeps the system and the timeline, and the ledger's commits are durable: no claim was lost, so
    nothing waits a lease (held on every restart, the keyed tasks of a cluster paused a minute each time)."""
    with start_postgres(use_env=False) as server:
        assert isinstance(server, PostgresServer)
        engine = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/postgres", pool_pre_ping=True)
        try:
            migrate(engine)
            ledger = Ledger(engine, holder="host:1:bbbb", lease=LEASE)
            first = _admit(ledger, "before", "acct:1")
            assert first.verdict is Verdict.ADMITTED
            with engine.begin() as conn:
                started = identity_check(conn, lease=LEASE).current  # the identity is on record
            server.restart()
            engine.dispose()
            changes = remembered(engine).changes
            with caplog.at_level(logging.WARNING, logger="celery_keyed"), engine.begin() as conn:
                check = identity_check(conn, lease=LEASE)
            assert check.current != started  # restarted: a new postmaster start
            assert check.hold_until is None
            assert remembered(engine).changes == changes  # not a failover
            assert "ledger failover" not in caplog.text
            assert _admit(ledger, "after", "acct:2").verdict is Verdict.ADMITTED  # no hold: admitted at once
            with engine.connect() as conn:
                assert conn.scalar(sa.text("SELECT count(*) FROM keyed_events WHERE kind = 'failover'")) == 0
                assert conn.scalar(sa.text("SELECT count(*) FROM keyed_claims WHERE task_id = 'before'")) == 1
        finally:
            engine.dispose()


def test_a_claim_lost_with_a_shard_change_is_taken_back_within_the_new_servers_layout(
    pair: tuple[PostgresServer, PostgresStandby],
) -> None:
    """Failover and a shard change: the old primary lowered a K = 2 gate from 2 shards to 1 and admitted a reader
    after its standby's last WAL; the promoted standby still has 2 rows of share 1, one held. The lost reader takes its
    row back; a claim that would put a second reader on a full row, or a writer beside a reader, is refused; the key's
    bound (the sum over its rows) holds throughout, and the new server's own shard change then waits for what it
    holds."""
    from celery_keyed.ledger import EXCLUSIVE_COST, NameConfig

    primary, standby = pair
    engine = sa.create_engine(multi_host_url([primary, standby], "postgres"), pool_pre_ping=True)
    ledger = Ledger(engine, holder="host:1:aaaa", lease=LEASE)

    def rows() -> dict[int, int]:
        with engine.connect() as conn:
            found = conn.execute(sa.text("SELECT shard, used FROM keyed_slots WHERE key = 'doc:1' AND used > 0"))
            return {r.shard: r.used for r in found}

    def reassert(holding: ClaimHolding, holder: str) -> str:
        with engine.begin() as conn:
            return claims_reassert(conn, holding, holder=holder, task_name="t", lease=LEASE)

    try:
        ledger.configure({"doc": NameConfig("doc", limit=2, shards=2)})
        kept = _admit(ledger, "kept", "doc:1")
        assert kept.admitted and kept.shard is not None
        standby.wait_caught_up()
        standby.detach()  # what follows is lost with the primary
        lost = _admit(ledger, "lost", "doc:1")
        assert lost.admitted and lost.fence is not None and lost.shard is not None and lost.shard != kept.shard
        ledger.configure({"doc": NameConfig("doc", limit=2, shards=1)}, version=1)
        crash(primary)
        standby.promote()
        engine.dispose()
        with engine.begin() as conn:
            assert identity_check(conn, lease=LEASE).hold_until is not None
        assert rows() == {kept.shard: 1}  # the promoted standby: the 2-shard layout, the lost claim gone

        holding = ClaimHolding("lost", 0, lost.fence, "doc:1", lost.shard, 1, "doc", composite=False)
        assert reassert(holding, ledger.holder) == "reasserted"
        assert sorted(rows().values()) == [1, 1]
        # a third reader on either row: each row's share (1 of K = 2 over 2 shards) is taken
        for shard in (kept.shard, lost.shard):
            extra = ClaimHolding(f"extra{shard}", 0, lost.fence + 10 + shard, "doc:1", shard, 1, "doc", composite=False)
            assert reassert(extra, "host:2:bbbb") == "refused"
        # a writer (the whole key, alone) beside the readers
        writer = ClaimHolding("writer", 0, lost.fence + 20, "doc:1", 0, EXCLUSIVE_COST, "doc", composite=False)
        assert reassert(writer, "host:2:bbbb") == "refused"
        assert sum(rows().values()) == 2

        # once the hold is over the new server's own change to 1 shard may move the key (both readers fit a row of
        # share 2); a new reader then waits: the key's bound is the same K = 2
        def admitted_elsewhere() -> bool:
            try:
                return _admit(ledger, "other", "acct:9").verdict is Verdict.ADMITTED
            except sa.exc.OperationalError:
                return False

        _poll(admitted_elsewhere)
        ledger.configure({"doc": NameConfig("doc", limit=2, shards=1)}, version=2)
        assert _admit(ledger, "third", "doc:1").verdict is Verdict.PARKED
        assert sum(rows().values()) == 2
        assert ledger.release(Token("lost", 0), lost.fence, Outcome.COMPLETED).released
        # the key still holds a reader on a row the new layout drops: until the sweep moves it, it runs below K (never
        # above); then the parked reader takes the freed slot on the one row
        assert sum(rows().values()) <= 2

        def moved_and_promoted() -> bool:
            ledger.sweep()
            return sum(rows().values()) == 2

        _poll(moved_and_promoted)
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT DISTINCT shards FROM keyed_slots WHERE key = 'doc:1'")) == 1
            assert conn.scalar(sa.text("SELECT max(used) FROM keyed_slots WHERE key = 'doc:1'")) == 2
    finally:
        engine.dispose()
