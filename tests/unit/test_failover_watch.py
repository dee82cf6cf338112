"""The failover watch's memory (celery_keyed.ledger.identity, celery_keyed.worker.failover): a change of the ledger's
server is logged once per process and counted; a missing claim is re-asserted only after a failover."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa

from celery_keyed import metrics
from celery_keyed.ledger.claims import HeldClaim
from celery_keyed.ledger.identity import IdentityCheck, ProcessIdentity, remembered
from celery_keyed.worker.failover import FailoverWatch

FIRST = "system 1, timeline 1, started 2026-01-01 00:00:00+00"
PROMOTED = "system 1, timeline 2, started 2026-01-01 00:00:05+00"


def test_a_change_of_server_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    memory = ProcessIdentity()
    with caplog.at_level(logging.ERROR, logger="celery_keyed"):
        assert not memory.observe(IdentityCheck(None, None, FIRST, None))  # the first contact: nothing to compare
        assert not memory.observe(IdentityCheck(None, None, FIRST, None))
        assert caplog.text == ""
        assert memory.observe(IdentityCheck(None, None, PROMOTED, None))  # another process recorded it first
        assert not memory.observe(IdentityCheck(None, None, PROMOTED, None))
    assert memory.changes == 1
    assert caplog.text.count("ledger failover:") == 1


def test_the_detector_names_what_changed(caplog: pytest.LogCaptureFixture) -> None:
    memory = ProcessIdentity()
    with caplog.at_level(logging.ERROR, logger="celery_keyed"):
        assert memory.observe(IdentityCheck("promoted", FIRST, PROMOTED, None))
    assert "ledger failover: a standby was promoted" in caplog.text and FIRST in caplog.text


class _Ledger:
    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url)
        self.holder = "host:1:aaaa"


@pytest.mark.skipif(not metrics.enabled(), reason="prometheus_client is not installed")
def test_the_watch_counts_a_failover_and_only_then_takes_claims_back() -> None:
    ledger = _Ledger("postgresql+psycopg://u@127.0.0.1:1/ledger-of-this-test")
    watch = FailoverWatch(lambda: ledger, lambda: None, lease=10.0)  # type: ignore[arg-type, return-value]
    claim = HeldClaim("t", 0, 7)
    before = metrics.FAILOVERS._value.get()
    # no failover seen: a missing claim is not taken back (it was reclaimed; the self-fence stops its body)
    assert watch.reassert([(claim, "task")]) == set()
    assert not watch.after_failover()
    remembered(ledger.engine).observe(IdentityCheck(None, None, FIRST, None))
    remembered(ledger.engine).observe(IdentityCheck("promoted", FIRST, PROMOTED, None))
    assert watch.after_failover()
    assert metrics.FAILOVERS._value.get() == before + 1
    watch.counted()
    assert metrics.FAILOVERS._value.get() == before + 1  # once
    # another ledger's memory is its own
    other = _Ledger("postgresql+psycopg://u@127.0.0.1:2/another-ledger")
    assert not FailoverWatch(lambda: other, lambda: None, lease=10.0).after_failover()  # type: ignore[arg-type, return-value]


def test_after_a_failover_no_missing_claim_is_taken_for_reclaimed() -> None:
    """Before a failover a claim a renewal did not find was reclaimed: its body is stopped at once. After one it may
    have been lost with the old server: it is re-asserted, or left to the self-fence's deadline, never stopped as
    reclaimed."""
    from types import SimpleNamespace

    ledger = _Ledger("postgresql+psycopg://u@127.0.0.1:3/ledger-of-take-back")
    watch = FailoverWatch(lambda: ledger, lambda: None, lease=10.0)  # type: ignore[arg-type, return-value]
    entry = SimpleNamespace(request=SimpleNamespace(name="task"), lease_from=0.0)
    missing = {HeldClaim("t", 0, 7): entry}
    assert watch.take_back(missing, 1.0) == [entry]  # type: ignore[arg-type]
    remembered(ledger.engine).observe(IdentityCheck(None, None, FIRST, None))
    remembered(ledger.engine).observe(IdentityCheck("promoted", FIRST, PROMOTED, None))
    assert watch.take_back(missing, 1.0) == []  # type: ignore[arg-type]
    assert entry.lease_from == 0.0  # not re-asserted (nothing known of what it held): its deadline stands
