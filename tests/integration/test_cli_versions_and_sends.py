"""``celery keyed status`` shows the stored configuration version and the version each worker runs (issue 14
item 7), and the sends accepted and refused at send (item 3)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_keyed.ledger import Ledger, NameConfig
from celery_keyed.publisher import close_publisher
from tests.integration.test_cli import run, run_json


@pytest.fixture
def app(database_url: str, redis_url: str) -> Iterator[Celery]:
    app = Celery("cli-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    yield app
    close_publisher(app)
    app.close()


def test_status_shows_versions_of_workers(app: Celery, engine) -> None:
    new = Ledger(engine, holder="w-new:1:aaaa")
    old = Ledger(engine, holder="w-old:2:bbbb")
    for ledger in (new, old):
        ledger.register_holder()
    new.configure({"api": NameConfig("api", limit=3)}, version=2)
    old.configure({"api": NameConfig("api", limit=1)}, version=1)
    doc = run_json(app, "status")
    assert doc["config_version"] == 2
    assert {w["hostname"]: w["config_version"] for w in doc["workers"]} == {"w-new": 2, "w-old": 1}
    assert next(n for n in doc["names"] if n["name"] == "api")["config_version"] == 2
    assert "worker w-old runs configuration version 1, older than the stored 2" in doc["notes"]
    assert any("this app's keyed_config_version is 0" in note for note in doc["notes"])
    out = run(app, "status").stdout
    assert "configuration version stored: 2" in out
    line = next(x for x in out.splitlines() if x.startswith("w-old"))
    assert line.split()[-3:] == ["1", "older", "0"]


def test_status_shows_sends(app: Celery, ledger: Ledger) -> None:
    ledger.configure({"api": NameConfig("api", limit=1, max_waiting=1)})
    assert ledger.admit_at_send("a", "api:1", dedupe_key="d").accepted
    assert not ledger.admit_at_send("b", "api:1").accepted
    assert not ledger.admit_at_send("c", "api:2", dedupe_key="d").accepted
    doc = run_json(app, "status")
    assert doc["sends"] == [{"name": "api", "in_flight": 1, "refused_full": 1, "refused_duplicate": 1}]
    out = run(app, "status").stdout
    assert "REFUSED ROOM FULL" in out and any(x.split() == ["api", "1", "1", "1"] for x in out.splitlines())
