"""Limits safe during rolling deploys (issue 14 item 7): name configuration carries keyed_config_version; a worker
started with an older version never overwrites what a newer one stored (guarded in SQL), logs that it runs older
configuration, and each holder records the version it runs."""

from __future__ import annotations

import logging
import threading

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import Ledger, NameConfig


def _limit(scalar, name: str) -> object:
    return scalar("SELECT slot_limit FROM keyed_names WHERE name = :name", name=name)


def test_older_version_keeps_newer_limits(engine: sa.Engine, scalar, caplog: pytest.LogCaptureFixture) -> None:
    new = Ledger(engine, holder="new:1:aaaa")
    old = Ledger(engine, holder="old:2:bbbb")
    new.register_holder()
    old.register_holder()
    new.configure({"stripe": NameConfig("stripe", limit=10, max_waiting=50)}, version=2)
    with caplog.at_level(logging.WARNING, logger="celery_keyed"):
        old.configure(
            {"stripe": NameConfig("stripe", limit=3), "legacy": NameConfig("legacy", limit=2)}, version=1
        )
    assert (_limit(scalar, "stripe"), scalar("SELECT max_waiting FROM keyed_names WHERE name = 'stripe'")) == (10, 50)
    assert scalar("SELECT config_version FROM keyed_names WHERE name = 'stripe'") == 2
    assert _limit(scalar, "legacy") is None  # nor does it add a name while a newer configuration rules
    assert "runs configuration version 1, older than version 2" in caplog.text and "legacy, stripe" in caplog.text
    newest, holders = new.config_versions()
    assert newest == 2
    assert {h.holder: h.config_version for h in holders} == {"new:1:aaaa": 2, "old:2:bbbb": 1}


def test_equal_versions_behave_as_before_and_newer_overwrites(engine: sa.Engine, scalar, caplog) -> None:
    ledger = Ledger(engine, holder="w:1:aaaa")
    ledger.configure({"stripe": NameConfig("stripe", limit=10)})  # default version 0
    with caplog.at_level(logging.WARNING, logger="celery_keyed"):
        ledger.configure({"stripe": NameConfig("stripe", limit=4)})  # same version: the last writer wins
    assert _limit(scalar, "stripe") == 4 and caplog.text == ""
    ledger.configure({"stripe": NameConfig("stripe", limit=7)}, version=3)
    ledger.configure({"stripe": NameConfig("stripe", limit=8), "b": NameConfig("b", limit=2)}, version=3)
    assert (_limit(scalar, "stripe"), _limit(scalar, "b")) == (8, 2)
    ledger.configure({"stripe": NameConfig("stripe", limit=1)}, version=2)
    assert _limit(scalar, "stripe") == 8


def test_a_raised_limit_of_a_kept_name_promotes_nothing(engine: sa.Engine, scalar) -> None:
    """Only written names are promoted: an older worker's higher limit never lets anyone in."""
    from celery_keyed.ledger import Arrival, Verdict

    ledger = Ledger(engine, holder="w:1:aaaa")
    ledger.configure({"g": NameConfig("g", limit=1)}, version=2)
    assert ledger.admit(Arrival("a", key="g:1")).verdict is Verdict.ADMITTED
    assert ledger.admit(Arrival("b", key="g:1")).verdict is Verdict.PARKED
    assert ledger.configure({"g": NameConfig("g", limit=5)}, version=1) == []
    assert scalar("SELECT count(*) FROM keyed_claims") == 1


def test_concurrent_configures_newest_wins(database_url: str, scalar) -> None:
    """Versions 1..8 configure at once, each in its own connection: version 8's limit is stored, whatever order."""
    engine = sa.create_engine(database_url, pool_size=8, max_overflow=0)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def run(version: int) -> None:
        try:
            ledger = Ledger(engine, holder=f"w{version}:1:aaaa")
            barrier.wait()
            ledger.configure({"hot": NameConfig("hot", limit=version * 10)}, version=version)
        except BaseException as exc:
            errors.append(exc)

    try:
        for _ in range(3):
            threads = [threading.Thread(target=run, args=(v,)) for v in range(1, 9)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == []
            assert (_limit(scalar, "hot"), scalar("SELECT config_version FROM keyed_names")) == (80, 8)
            barrier.reset()
    finally:
        engine.dispose()
