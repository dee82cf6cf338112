"""The hot path keeps its plans for the session (issue 13; migration 0021). PL/pgSQL keeps a statement's plan once
its generic plan costs no more than the custom ones; a statement that folds an argument into a constant (a boolean
joined to a subquery, a join against ``unnest`` of an array argument) always looks cheaper planned afresh, so it was
planned again on every call. Counted by pg_stat_statements (``track = all``, ``track_planning``) on a server of its
own: after a warm-up, no statement inside the park or the release-and-promote is planned as often as it runs."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_keyed.ledger import Arrival, Ledger, Outcome, Token, Verdict, migrate
from celery_keyed.testing import start_postgres

CYCLES = 40

# Statements allowed to be planned at every call: the call of a function from another one's FROM (one line each,
# no table of its own).
WRAPPERS = ("SELECT * FROM keyed_admit_or_park_plain(",)


@pytest.fixture(scope="module")
def profiled_url() -> Iterator[str]:
    settings = {
        "shared_preload_libraries": "pg_stat_statements",
        "pg_stat_statements.track": "all",
        "pg_stat_statements.track_planning": "on",
    }
    with start_postgres(settings=settings, use_env=False) as pg:  # a server of its own: the preloaded library
        yield pg.url


def test_no_statement_of_the_park_or_the_release_is_planned_at_every_call(profiled_url: str) -> None:
    engine = sa.create_engine(profiled_url, pool_size=1, max_overflow=0)
    admin = make_url(profiled_url).set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        migrate(engine)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        ledger = Ledger(engine, holder="plans", lease=30.0, dispatch=10.0)
        held = ledger.admit(Arrival("p0", key="acct:plans"))
        assert held.verdict is Verdict.ADMITTED and held.fence is not None
        token, fence = Token("p0", 0), held.fence
        for i in range(1, CYCLES + 1):
            assert ledger.admit(Arrival(f"p{i}", key="acct:plans")).verdict is Verdict.PARKED
            report = ledger.release(token, fence, Outcome.COMPLETED)
            (promotion,) = report.promotions
            assert promotion.nonce is not None
            bound = ledger.bind(promotion.token, promotion.nonce)
            assert bound is not None
            token, fence = promotion.token, bound
        ledger.release(token, fence, Outcome.COMPLETED)
        with psycopg.connect(admin, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT calls, plans, query FROM pg_stat_statements"
                " WHERE NOT toplevel AND calls >= %s AND plans > calls - 10",
                (CYCLES - 5,),
            ).fetchall()
    finally:
        engine.dispose()
    replanned = [" ".join(q.split())[:200] for _, _, q in rows if not q.lstrip().startswith(WRAPPERS)]
    assert not replanned, replanned
