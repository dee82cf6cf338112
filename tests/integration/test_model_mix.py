"""Features meeting on one key, on real Postgres (hypothesis stateful testing): readers and writers, weighted
attempts, attempts on two keys, changes of the shard count and of the limit (the name's configuration, its
override, the key's own limit and pause), a rate (a token bucket per key) and rate windows, claims given back before
they started (a claim taken ahead that no pool process started), revokes, leases lapsing, the sweep and the reconciler
— mixed in any order.

Where test_model.py predicts every answer of the ledger from a model, this machine checks only what must hold
whatever the answers were, on the database itself, after every step:

- the bound of every key (D1, D18): the slots held on the key (running and promoted claims, a multi-key waiter's
  reservations) never sum above the largest limit in effect since its oldest holding; an exclusive holder is the
  key's only holder;
- the counters equal the holdings (reconcile's own check finds no drift);
- the books balance (every arrival is open or has one outcome);
- the rate of every key: over any span of t seconds at most ``burst + rate·t`` tokens were taken from its bucket, and
  any window of T seconds holds at most N of its starts, for each window (N, T) of the name — counted from every
  claim row the ledger ever wrote (a start, whichever path made it), recorded by a trigger of the test's own;
- no lost wakeup (D2): once the sweep ran, a second sweep at the same moment has nothing left to promote.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_keyed.ledger import (
    EXCLUSIVE_COST,
    Admission,
    Arrival,
    HeldClaim,
    Ledger,
    NameConfig,
    Outcome,
    Promotion,
    Token,
    Verdict,
)

LEASE = 8.0
DISPATCH = 5.0
HOLDER = "mix-host:1:beef"
KEYS = ("doc:1", "doc:2")
EPOCH = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)

# What arrives: a reader (cost 1), a weighted reader (cost 2), a writer (exclusive), a reader of both keys.
KINDS = st.sampled_from(["reader", "reader", "weighted", "writer", "writer", "both"])

# The name's rate for a whole run (rate per second, burst), and its rate windows ((N, seconds), ...).
RATES = st.sampled_from([None, (1.0, 1.0), (0.5, 2.0), (2.0, 3.0)])
WINDOWS = st.sampled_from([None, ((2, 5.0),), ((1, 3.0), (3, 10.0))])

# Every claim row the ledger writes is a start (admitted, or promoted: a promotion takes its tokens whether it is
# bound or not): the observer of the rate invariants, independent of what the calls answer.
STARTS_OBSERVER = (
    "CREATE TABLE mix_starts (task_id text, attempt integer, keys text[], cost integer, at timestamptz)",
    """
    CREATE FUNCTION mix_record_start() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO mix_starts VALUES (NEW.task_id, NEW.attempt, NEW.key || COALESCE(NEW.extra_keys, '{}'),
                                       NEW.cost, NEW.claimed_at);
        RETURN NULL;
    END $$
    """,
    "CREATE TRIGGER mix_record_start AFTER INSERT ON keyed_claims FOR EACH ROW EXECUTE FUNCTION mix_record_start()",
)


@dataclass
class Running:
    token: Token
    fence: int
    arrival: Arrival


class MixMachine(RuleBasedStateMachine):
    def __init__(self, engine: sa.Engine, tables: list[str]) -> None:
        super().__init__()
        self.engine = engine
        with engine.begin() as conn:
            conn.execute(sa.text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY"))
            if conn.execute(sa.text("SELECT to_regclass('mix_starts')")).scalar_one() is None:
                for statement in STARTS_OBSERVER:
                    conn.execute(sa.text(statement))
            conn.execute(sa.text("TRUNCATE mix_starts"))
        self.ledger = Ledger(engine, holder=HOLDER, lease=LEASE, dispatch=DISPATCH)
        self.now = EPOCH
        self.ids = itertools.count(1)
        self.arrivals: dict[str, Arrival] = {}  # task id -> its last arrival
        self.running: dict[Token, Running] = {}
        self.promotions: list[Promotion] = []
        self.lost: list[Arrival] = []  # attempts given back as worker lost: the broker delivers them again
        self.max_limit: dict[str, int] = {}
        self.rate: tuple[float, float] | None = None
        self.windows: tuple[tuple[int, float], ...] | None = None

    # -- helpers ------------------------------------------------------------------------------------------
    def took(self, promotions: Any) -> None:
        self.promotions += list(promotions)

    def limits(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return {
                k: int(
                    conn.execute(sa.text("SELECT keyed_key_limit(:k, :now)"), {"k": k, "now": self.now}).scalar_one()
                )
                for k in KEYS
            }

    def holdings(self) -> dict[str, list[int]]:
        """key -> the cost of every holding of it: claims (their first key and extra keys) and reservations."""
        held: dict[str, list[int]] = {k: [] for k in KEYS}
        with self.engine.connect() as conn:
            for r in conn.execute(sa.text("SELECT key, extra_keys, cost FROM keyed_claims WHERE key IS NOT NULL")):
                for k in [r.key, *(r.extra_keys or [])]:
                    held[k].append(int(r.cost))
            for r in conn.execute(
                sa.text("SELECT reserved_keys, cost FROM keyed_waiting WHERE reserved_at IS NOT NULL")
            ):
                for k in r.reserved_keys or []:
                    held[k].append(int(r.cost))
        return held

    def track(self) -> None:
        """The largest limit in effect since each key's oldest holding (read before and after every step)."""
        limits, held = self.limits(), self.holdings()
        for k in KEYS:
            if held[k]:
                self.max_limit[k] = max(self.max_limit.get(k, 0), limits[k])
            else:
                self.max_limit[k] = limits[k]

    def admit(self, arrival: Arrival) -> None:
        self.track()
        self.decided(arrival, self.ledger.admit(arrival, now=self.now))

    def decided(self, arrival: Arrival, result: Admission) -> None:
        """What an admission answered: the arrival remembered, its claim running, its promotions to bind."""
        self.arrivals[arrival.task_id] = arrival
        if result.verdict is Verdict.ADMITTED:
            assert result.fence is not None
            token = Token(arrival.task_id, arrival.attempt)
            self.running[token] = Running(token, result.fence, arrival)
        self.took(result.promotions)

    def new_arrival(self, kind: str, key: str, tenant: str | None = None) -> Arrival:
        """A new task of ``kind`` (KINDS) on ``key``."""
        task_id = f"t{next(self.ids)}"
        other = KEYS[1] if key == KEYS[0] else KEYS[0]
        cost = {"weighted": 2, "writer": EXCLUSIVE_COST}.get(kind, 1)
        extra = (other,) if kind == "both" else ()
        return Arrival(task_id, key=key, cost=cost, extra_keys=extra, fair_key=tenant, message={"id": task_id})

    # -- rules ----------------------------------------------------------------------------------------------
    def config(self, limit: int, shards: int, fair: bool) -> NameConfig:
        rate, burst = self.rate or (None, None)
        return NameConfig("doc", limit=limit, shards=shards, fair=fair, rate=rate, burst=burst, windows=self.windows)

    @initialize(limit=st.integers(0, 4), shards=st.integers(1, 3), fair=st.booleans(), rate=RATES, windows=WINDOWS)
    def start(
        self,
        limit: int,
        shards: int,
        fair: bool,
        rate: tuple[float, float] | None,
        windows: tuple[tuple[int, float], ...] | None,
    ) -> None:
        self.rate, self.windows = rate, windows
        self.ledger.configure({"doc": self.config(limit, shards, fair)}, now=self.now)

    @rule(kind=KINDS, key=st.sampled_from(KEYS), tenant=st.sampled_from([None, "a", "b"]))
    def arrive(self, kind: str, key: str, tenant: str | None) -> None:
        self.admit(self.new_arrival(kind, key, tenant))

    @rule(kinds=st.lists(st.tuples(KINDS, st.sampled_from(KEYS)), min_size=2, max_size=4))
    def arrive_together(self, kinds: list[tuple[str, str]]) -> None:
        """Arrivals decided in one batch (a worker's claims taken ahead, its admission thread)."""
        arrivals = [self.new_arrival(kind, key) for kind, key in kinds]
        self.track()
        for arrival, result in zip(arrivals, self.ledger.admit_many(arrivals, now=self.now), strict=True):
            self.decided(arrival, result)

    @precondition(lambda self: self.lost)
    @rule(data=st.data())
    def redelivered(self, data: st.DataObject) -> None:
        """A message given back as worker lost (a lost run, a claim taken ahead that no process started) comes
        back from the broker."""
        arrival = data.draw(st.sampled_from(self.lost))
        self.lost.remove(arrival)
        self.admit(arrival)

    @precondition(lambda self: self.promotions)
    @rule(data=st.data())
    def bind(self, data: st.DataObject) -> None:
        p = data.draw(st.sampled_from(self.promotions))
        self.promotions.remove(p)
        assert p.nonce is not None
        token = Token(p.task_id, p.attempt)
        fence = self.ledger.bind(token, p.nonce, now=self.now)
        if fence is not None:
            arrival = self.arrivals.get(p.task_id) or Arrival(p.task_id, key=p.key)
            self.running[token] = Running(token, fence, arrival)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), outcome=st.sampled_from([Outcome.COMPLETED, Outcome.FAILED, Outcome.WORKER_LOST]))
    def release(self, data: st.DataObject, outcome: Outcome) -> None:
        """An attempt ends; or (worker lost) a claim taken ahead is given back unstarted, or its run was lost."""
        token = data.draw(st.sampled_from(sorted(self.running, key=str)))
        run = self.running.pop(token)
        self.track()
        report = self.ledger.release(token, run.fence, outcome, now=self.now)
        self.took(report.promotions)
        if outcome is Outcome.WORKER_LOST and report.released:
            self.lost.append(run.arrival)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def release_early(self, data: st.DataObject) -> None:
        """The body gives its slots back before it ends (release_concurrency); it ends later."""
        token = data.draw(st.sampled_from(sorted(self.running, key=str)))
        self.track()
        _, promotions = self.ledger.release_early(token, self.running[token].fence, now=self.now)
        self.took(promotions)

    @precondition(lambda self: self.arrivals)
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        task_id = data.draw(st.sampled_from(sorted(self.arrivals)))
        self.track()
        self.took(self.ledger.revoke(task_id, now=self.now))

    @rule(limit=st.integers(0, 4), shards=st.integers(1, 3), fair=st.booleans())
    def configure(self, limit: int, shards: int, fair: bool) -> None:
        self.track()
        self.took(self.ledger.configure({"doc": self.config(limit, shards, fair)}, now=self.now))

    @rule(tenant=st.sampled_from(["a", "b"]), weight=st.sampled_from([0.5, 1.0, 3.0]))
    def fair_weight(self, tenant: str, weight: float) -> None:
        """A runtime weight for a tenant of the (maybe) fair name: it makes no room, so it promotes nothing."""
        self.ledger.set_fair_weight("doc", tenant, weight, reason="mix", now=self.now)

    @rule(limit=st.none() | st.integers(0, 4), expires_in=st.sampled_from([None, 3, 20]))
    def name_override(self, limit: int | None, expires_in: int | None) -> None:
        self.track()
        if limit is None:
            self.took(self.ledger.clear_override("doc", reason="mix", now=self.now))
            return
        expires_at = None if expires_in is None else self.now + timedelta(seconds=expires_in)
        self.took(self.ledger.set_override("doc", limit, reason="mix", expires_at=expires_at, now=self.now))

    @rule(
        key=st.sampled_from(KEYS),
        action=st.sampled_from(["limit", "clear", "pause", "resume"]),
        limit=st.integers(0, 4),
        seconds=st.sampled_from([3, 20]),
    )
    def key_override(self, key: str, action: str, limit: int, seconds: int) -> None:
        self.track()
        if action == "limit":
            self.took(self.ledger.set_key_limit(key, limit, reason="mix", expires_in=seconds, now=self.now))
        elif action == "clear":
            self.took(self.ledger.clear_key_limit(key, reason="mix", now=self.now) or [])
        elif action == "pause":
            self.ledger.pause_key(key, seconds=seconds, reason="mix", now=self.now)
        else:
            self.took(self.ledger.resume_key(key, reason="mix", now=self.now) or [])

    @precondition(lambda self: self.running)
    @rule()
    def renew(self) -> None:
        held = [HeldClaim(t.task_id, t.attempt, r.fence) for t, r in self.running.items()]
        self.ledger.renew(held, now=self.now)

    @rule(seconds=st.sampled_from([1, 3, 6, 11]), then=st.sampled_from(["sweep", "reconcile", None]))
    def advance(self, seconds: int, then: str | None) -> None:
        self.track()
        self.now += timedelta(seconds=seconds)
        self.track()
        if then is None:
            return
        if then == "sweep":
            report = self.ledger.sweep(now=self.now)
        else:
            report = self.ledger.reconcile(now=self.now)
            assert report.drift == [], report.drift
            for token in report.reclaimed:  # its lease lapsed: the run is lost, its message comes back
                run = self.running.pop(token, None)
                if run is not None:
                    self.lost.append(run.arrival)
        self.took(report.promotions)
        self.track()
        again = self.ledger.sweep(now=self.now)
        assert again.promotions == [], f"lost wakeup: a second sweep promoted {again.promotions}"

    # -- invariants -----------------------------------------------------------------------------------------
    @invariant()
    def the_bound_and_the_books(self) -> None:
        self.track()
        for key, costs in self.holdings().items():
            if any(c >= EXCLUSIVE_COST for c in costs):
                assert len(costs) == 1, f"{key}: an exclusive holder beside others: {costs}"
            else:
                assert sum(costs) <= self.max_limit[key], f"{key}: {costs} held, limit {self.max_limit[key]}"
        with self.engine.begin() as conn:
            drift = conn.execute(
                sa.text(
                    """
                    SELECT s.key, s.shard, s.used, COALESCE(h.n, 0) AS held FROM keyed_slots s
                    LEFT JOIN (
                        SELECT key, shard, sum(cost) AS n FROM keyed_claims WHERE key IS NOT NULL GROUP BY 1, 2
                        UNION ALL
                        SELECT x.key, x.shard, sum(c.cost) FROM keyed_claims c,
                               unnest(c.extra_keys, c.extra_shards) AS x(key, shard) GROUP BY 1, 2
                        UNION ALL
                        SELECT x.key, x.shard, sum(w.cost) FROM keyed_waiting w,
                               unnest(w.reserved_keys, w.reserved_shards) AS x(key, shard)
                         WHERE w.reserved_at IS NOT NULL GROUP BY 1, 2
                    ) h ON h.key = s.key AND h.shard = s.shard
                    """
                )
            ).all()
        per_row: dict[tuple[str, int], tuple[int, int]] = {}
        for r in drift:
            used, held = per_row.get((r.key, r.shard), (r.used, 0))
            per_row[(r.key, r.shard)] = (used, held + int(r.held))
        assert all(u == h for u, h in per_row.values()), per_row
        books = self.ledger.books()
        assert books.get("arrivals", 0) == sum(v for k, v in books.items() if k != "arrivals"), books
        self.check_rates()

    def check_rates(self) -> None:
        """Every start the ledger made, against the name's bucket and windows, key by key."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT task_id, keys, cost, at FROM mix_starts ORDER BY at")).all()
        for r in rows:
            assert r.at >= EPOCH, f"a start stamped outside the model's clock: {r}"
        for key in KEYS:
            # (seconds since the epoch, tokens): an exclusive start takes one token and one place, like a start
            starts = [
                ((r.at - EPOCH).total_seconds(), 1 if r.cost >= EXCLUSIVE_COST else int(r.cost))
                for r in rows
                if key in r.keys
            ]
            if self.rate is not None:
                rate, burst = self.rate
                for i, (first, _) in enumerate(starts):
                    taken = 0
                    for at, tokens in starts[i:]:
                        taken += tokens
                        allowed = burst + rate * (at - first)
                        assert taken <= allowed + 1e-6, (
                            f"{key}: {taken} tokens taken in {at - first:g} s from {first:g} (rate {rate}/s, burst"
                            f" {burst}: at most {allowed:g}); starts {starts}"
                        )
            for n, seconds in self.windows or ():
                places = [at for at, tokens in starts for _ in range(tokens)]
                for j in range(n, len(places)):
                    assert places[j] - places[j - n] >= seconds - 1e-6, (
                        f"{key}: {n + 1} starts within {places[j] - places[j - n]:g} s, window {n}/{seconds:g}s;"
                        f" starts {starts}"
                    )


@pytest.fixture
def ledger_tables(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
                    " AND tablename LIKE 'keyed\\_%' AND tablename <> 'keyed_migrations' ORDER BY tablename"
                )
            ).scalars()
        )


@pytest.mark.timeout(900)
def test_features_meeting_keep_the_bound_and_the_books(engine: sa.Engine, ledger_tables: list[str]) -> None:
    run_state_machine_as_test(
        lambda: MixMachine(engine, ledger_tables),  # type: ignore[arg-type]
        settings=settings(
            max_examples=int(os.environ.get("KEYED_MODEL_EXAMPLES", "40")),
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )
