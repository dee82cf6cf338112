"""Debounce (issue 14 item 2) where operators look: ``celery keyed status`` counts the debounced tasks still in
their quiet period per name, and ``celery keyed explain`` says until when one is debounced."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from celery import Celery

from celery_keyed.ledger import Arrival, Ledger, Verdict
from celery_keyed.publisher import close_publisher
from tests.integration.test_cli import run, run_json


@pytest.fixture
def app(database_url: str, redis_url: str) -> Iterator[Celery]:
    app = Celery("cli-test", broker=redis_url, set_as_current=False)
    app.conf.keyed_database_url = database_url
    yield app
    close_publisher(app)
    app.close()


def test_status_and_explain_show_a_debounced_task(app: Celery, ledger: Ledger) -> None:
    for i in range(3):
        arrival = Arrival(f"d{i}", key="search:7", task_name="proj.reindex", debounce=60.0)
        assert ledger.admit(arrival).verdict is Verdict.PARKED
    assert ledger.admit(Arrival("r0", key="search:8")).verdict is Verdict.ADMITTED
    assert ledger.admit(Arrival("r1", key="search:8")).verdict is Verdict.PARKED  # waiting, not debounced
    (search,) = run_json(app, "status")["names"]
    assert (search["waiting"], search["debounced"]) == (2, 1)
    assert "2 (1 debounced)" in run(app, "status").stdout
    out = run(app, "explain", "d2").stdout
    assert "debounced until" in out and "at the latest" in out
    assert "superseded" in run(app, "explain", "d0").stdout  # replaced by d1: its outcome, recorded
