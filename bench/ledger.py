"""Ledger claim+release throughput against the raw two-commit and autocommit patterns (DESIGN §8), side by side.

    python -m bench.ledger [--seconds 5] [--rounds 1] [--clients 4]

Starts its own durable PostgreSQL (fsync on; ``celery_keyed.testing.start_postgres(durable=True)``) unless
``KEYED_DATABASE_URL`` names a server, creates and migrates a database of its own, and drives every scenario
with the same client processes (spawned once, each with its own SQLAlchemy Core engine on psycopg 3 and one
connection):

- ledger, 1,000 uncontended mutex keys — each client cycles over its own quarter of the keys;
- ledger, one hot gate, K = 100 (the clients never fill it, so nothing parks), 1 shard;
- ledger, the same gate with 8 shards;
- raw, single row:  ``BEGIN; UPDATE counter SET n = n + 1 WHERE id = 1; COMMIT; BEGIN; UPDATE … n - 1 …; COMMIT``;
- raw, 1,000 rows:  the same, each client cycling over its own quarter of the rows;
- raw autocommit, single row / 1,000 rows: the same two UPDATEs with the connection in autocommit, each one a
  self-committing statement (no BEGIN / COMMIT round trips) — the fair baseline for the ledger's fast paths,
  which run that way too (``Ledger.admit`` / ``Ledger.release``: ``admit_autocommit`` / ``release_autocommit``).

- ledger, batch of 8 — ``admit_many`` of 8 arrivals on 8 of the client's mutex keys, then ``release_many`` of the 8
  (one ``keyed_claim_many`` and one ``keyed_release_many`` call); its rate is reported in batches/s and compared,
  as 8 x batches/s, with the unbatched mutex cycle rate (target ≥ 3x).

A cycle is one claim then one release; the claim latency is the wall time of the first. Ratios: mutex keys vs
raw 1,000 rows, hot gate vs raw single row, each against both raw patterns (target ≥ 0.7), 8 shards vs 1 shard
(target ≥ 1.25). With ``--rounds N`` the scenarios are interleaved N times and the medians are reported.

A profile (one client, no contention) follows the table: the statements each claim and release sends, their
mean time, and the WAL each cycle writes — the "why" when a ratio misses its target. Then the hot path, one client:
the p50 / p99 of a park (an arrival on a held mutex key: the fast claim, then ``keyed_admit_plain``) and of a
release-and-promote of that key (``keyed_release_many`` then ``keyed_promote_plain``), with and without
``contended`` (targets ≤ 2 ms p50).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, ReleaseRequest, Token, Verdict, migrate

KEYS = 1000
GATE_LIMIT = 100
BATCH = 8

RAW_CREATE = sa.text("CREATE TABLE counter (id integer PRIMARY KEY, n bigint NOT NULL DEFAULT 0)")
RAW_FILL = sa.text("INSERT INTO counter (id) SELECT g FROM generate_series(1, :rows) AS g")
RAW_TAKE = sa.text("UPDATE counter SET n = n + 1 WHERE id = :id")
RAW_GIVE = sa.text("UPDATE counter SET n = n - 1 WHERE id = :id")
WAL_LSN = sa.text("SELECT pg_current_wal_lsn()")
WAL_DIFF = sa.text("SELECT pg_wal_lsn_diff(CAST(:b AS pg_lsn), CAST(:a AS pg_lsn))")


@dataclass(frozen=True)
class Scenario:
    name: str
    label: str
    kind: str  # "ledger" | "raw"
    key: str | None = None  # one hot key, or None for the per-client spread over KEYS keys / rows


SCENARIOS = [
    Scenario("raw1", "raw two-commit, single row", "raw"),
    Scenario("raw1000", "raw two-commit, 1,000 rows", "raw"),
    Scenario("rawac1", "raw autocommit single statement, single row", "raw"),
    Scenario("rawac1000", "raw autocommit single statement, 1,000 rows", "raw"),
    Scenario("mutex", "ledger, 1,000 mutex keys", "ledger"),
    Scenario("gate1", f"ledger, hot gate K={GATE_LIMIT}, 1 shard", "ledger", key="gate1:stripe"),
    Scenario("gate8", f"ledger, hot gate K={GATE_LIMIT}, 8 shards", "ledger", key="gate8:stripe"),
    Scenario("multi", "ledger, 1,000 keys + a 2nd key each (multi-key)", "ledger"),
    Scenario("batch8", f"ledger, batch of {BATCH}, 1,000 mutex keys (batches/s)", "ledger"),
]
BY_NAME = {s.name: s for s in SCENARIOS}
NAMES = {
    "gate1": NameConfig("gate1", limit=GATE_LIMIT, shards=1),
    "gate8": NameConfig("gate8", limit=GATE_LIMIT, shards=8),
    "region": NameConfig("region", limit=100_000),
}
# Each ledger scenario is compared with the raw patterns that touch the same number of rows: the two-commit one
# (BEGIN / UPDATE / COMMIT) and the autocommit one (one self-committing UPDATE).
BASELINE = {"mutex": "raw1000", "gate1": "raw1", "gate8": "raw1"}
BASELINE_AUTOCOMMIT = {"mutex": "rawac1000", "gate1": "rawac1", "gate8": "rawac1"}


# -- the driver (one per client process) ----------------------------------------------------------------------


class Driver:
    """One client: a cycle function per scenario, on one engine with one connection."""

    def __init__(self, engine: sa.Engine, index: int, clients: int) -> None:
        self.engine = engine
        self.autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")  # as Ledger does
        self.ledger = Ledger(self.engine, lease=60)
        self.index = index
        self.mine = list(range(index, KEYS, clients))  # this client's keys / rows
        self.prefix = f"c{index}-{uuid.uuid4().hex[:8]}"
        self.seq = 0
        # Statements sent per claim and per release (under load: fast-path misses take the slow path).
        self.statements = 0
        self.counted = {"claim": 0, "release": 0}
        sa.event.listen(self.engine, "before_cursor_execute", self._count)

    def _count(self, *args: Any) -> None:
        self.statements += 1

    def cycle_for(self, scenario: Scenario) -> Callable[[int], float]:
        if scenario.kind == "raw":
            raw = self.raw_autocommit_cycle if scenario.name.startswith("rawac") else self.raw_cycle
            if scenario.name in ("raw1", "rawac1"):
                return lambda i: raw(1)
            return lambda i: raw(1 + self.mine[i % len(self.mine)])
        if scenario.key is not None:
            key = scenario.key
            return lambda i: self.ledger_cycle(key)
        if scenario.name == "batch8":
            return lambda i: self.batch_cycle(
                [f"acct:{self.mine[(i * BATCH + j) % len(self.mine)]}" for j in range(BATCH)]
            )
        if scenario.name == "multi":
            return lambda i: self.ledger_cycle(
                f"tenant:{self.mine[i % len(self.mine)]}", (f"region:{self.mine[i % len(self.mine)] % 8}",)
            )
        return lambda i: self.ledger_cycle(f"acct:{self.mine[i % len(self.mine)]}")

    def prepare(self, scenario: Scenario) -> None:
        """Untimed: touch every key / row this client will use (first use of a key creates its rows)."""
        cycle = self.cycle_for(scenario)
        single = scenario.key is not None or scenario.name in ("raw1", "rawac1")
        for i in range(10 if single else len(self.mine)):
            cycle(i)

    def ledger_cycle(self, key: str, extra: tuple[str, ...] = ()) -> float:
        self.seq += 1
        task_id = f"{self.prefix}-{self.seq}"
        sent = self.statements
        started = time.perf_counter()
        admission = self.ledger.admit(Arrival(task_id=task_id, key=key, extra_keys=extra))
        claim = time.perf_counter() - started
        if admission.verdict is not Verdict.ADMITTED or admission.fence is None:
            raise RuntimeError(f"{key}: {admission} (the benchmark never fills a key)")
        self.counted["claim"] += self.statements - sent
        sent = self.statements
        report = self.ledger.release(Token(task_id, 0), admission.fence, Outcome.COMPLETED)
        if not report.released or report.promotions:
            raise RuntimeError(f"{key}: unexpected release report {report}")
        self.counted["release"] += self.statements - sent
        return claim

    def batch_cycle(self, keys: list[str]) -> float:
        """admit_many of one arrival per key, then release_many of them all; the admit_many's wall time."""
        arrivals = []
        for key in keys:
            self.seq += 1
            arrivals.append(Arrival(task_id=f"{self.prefix}-{self.seq}", key=key))
        sent = self.statements
        started = time.perf_counter()
        admissions = self.ledger.admit_many(arrivals)
        claim = time.perf_counter() - started
        if any(a.verdict is not Verdict.ADMITTED or a.fence is None for a in admissions):
            raise RuntimeError(f"batch: {admissions} (the benchmark never fills a key)")
        self.counted["claim"] += self.statements - sent
        sent = self.statements
        done = zip(arrivals, admissions, strict=True)
        reports = self.ledger.release_many([ReleaseRequest(a.token, m.fence or 0, Outcome.COMPLETED) for a, m in done])
        if not all(r.released and not r.promotions for r in reports):
            raise RuntimeError(f"batch: unexpected release reports {reports}")
        self.counted["release"] += self.statements - sent
        return claim

    def raw_cycle(self, row: int) -> float:
        started = time.perf_counter()
        with self.engine.begin() as conn:
            conn.execute(RAW_TAKE, {"id": row})
        claim = time.perf_counter() - started
        with self.engine.begin() as conn:
            conn.execute(RAW_GIVE, {"id": row})
        return claim

    def raw_autocommit_cycle(self, row: int) -> float:
        started = time.perf_counter()
        with self.autocommit.connect() as conn:
            conn.execute(RAW_TAKE, {"id": row})
        claim = time.perf_counter() - started
        with self.autocommit.connect() as conn:
            conn.execute(RAW_GIVE, {"id": row})
        return claim


def _client(url: str, index: int, clients: int, barrier: Any, commands: Any, results: Any) -> None:
    """A client process: run the scenarios the parent sends until it sends None."""
    driver = Driver(sa.create_engine(url, pool_size=1, max_overflow=0), index, clients)
    try:
        while (command := commands.get()) is not None:
            name, warmup, seconds = command
            scenario = BY_NAME[name]
            cycle = driver.cycle_for(scenario)
            driver.prepare(scenario)
            barrier.wait()
            start = time.monotonic()
            measure_from, end = start + warmup, start + warmup + seconds
            latencies: list[float] = []
            total = 0
            driver.counted = {"claim": 0, "release": 0}
            while (now := time.monotonic()) < end:
                claim = cycle(total)
                total += 1
                if now >= measure_from:
                    latencies.append(claim)
            results.put((index, total, latencies, dict(driver.counted)))
    finally:
        driver.engine.dispose()


# -- the parent -------------------------------------------------------------------------------------------------


@dataclass
class Measure:
    rates: list[float] = field(default_factory=list)  # cycles/s, one per round
    latencies: list[float] = field(default_factory=list)  # claim seconds, all rounds
    wal: list[float] = field(default_factory=list)  # WAL bytes per cycle, one per round
    statements: list[dict[str, float]] = field(default_factory=list)  # per claim / release, one per round

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0


class Clients:
    def __init__(self, url: str, clients: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.barrier = ctx.Barrier(clients + 1)
        self.commands = [ctx.Queue() for _ in range(clients)]
        self.results = ctx.Queue()
        self.processes = [
            ctx.Process(target=_client, args=(url, i, clients, self.barrier, self.commands[i], self.results),
                        name=f"bench-client-{i}", daemon=True)
            for i in range(clients)
        ]
        for p in self.processes:
            p.start()

    def run(self, engine: sa.Engine, name: str, warmup: float, seconds: float) -> tuple[float, list[float], float,
                                                                                    dict[str, float]]:
        """Run one scenario on every client: cycles/s, the claim latencies, WAL bytes per cycle, statements per
        claim and per release."""
        for queue in self.commands:
            queue.put((name, warmup, seconds))
        self.barrier.wait(timeout=600)
        with engine.connect() as conn:
            lsn0 = conn.execute(WAL_LSN).scalar_one()
        cycles = 0
        total = 0
        latencies: list[float] = []
        statements = {"claim": 0, "release": 0}
        for _ in self.processes:
            _, n, lat, counted = self.results.get(timeout=warmup + seconds + 600)
            total += n
            cycles += len(lat)
            latencies += lat
            for phase in statements:
                statements[phase] += counted[phase]
        with engine.connect() as conn:
            lsn1 = conn.execute(WAL_LSN).scalar_one()
            wal = float(conn.execute(WAL_DIFF, {"a": str(lsn0), "b": str(lsn1)}).scalar_one())
        per_cycle = {phase: n / max(total, 1) for phase, n in statements.items()}
        return cycles / seconds, latencies, wal / max(total, 1), per_cycle

    def close(self) -> None:
        for queue in self.commands:
            queue.put(None)
        for p in self.processes:
            p.join(30)
            if p.is_alive():
                p.terminate()


@contextmanager
def fresh_database(server: Any, prefix: str) -> Iterator[tuple[str, dict[str, str]]]:
    """A database of its own on ``server`` (a ``celery_keyed.testing`` PostgreSQL), created and migrated, dropped
    after; yields (its SQLAlchemy URL, the server's ``server_version``, ``fsync`` and ``synchronous_commit``)."""
    admin_url = make_url(server.url).set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        shown = {}
        for setting in ("server_version", "fsync", "synchronous_commit"):
            row = admin.execute(f"SHOW {setting}").fetchone()
            shown[setting] = str(row[0]) if row else "?"
    try:
        url = server.url_for(name)
        engine = sa.create_engine(url)
        try:
            migrate(engine)
        finally:
            engine.dispose()
        yield url, shown
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def bench_database(settings: dict[str, str] | None = None) -> Iterator[tuple[str, str]]:
    """A fresh migrated database on a durable server (``settings``: extra server parameters, for a server the
    benchmark starts), with bench.ledger's raw tables and names; yields (SQLAlchemy URL, server description)."""
    from celery_keyed.testing import start_postgres

    with start_postgres(durable=True, settings=settings) as server, fresh_database(server, "keyed_bench") as (
        url, shown
    ):
        described = (f"PostgreSQL {shown['server_version']}, fsync={shown['fsync']}, "
                     f"synchronous_commit={shown['synchronous_commit']}, "
                     f"{'KEYED_DATABASE_URL' if not server.managed else 'started by the benchmark'}")
        engine = sa.create_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(RAW_CREATE)
                conn.execute(RAW_FILL, {"rows": KEYS})
            Ledger(engine).configure(NAMES)
        finally:
            engine.dispose()
        yield url, described


# -- the profile: what one claim and one release send ----------------------------------------------------------


def _statement_names() -> dict[int, str]:
    """id(TextClause) → "module.CONSTANT" for every named statement of the ledger."""
    from celery_keyed.ledger import books, claims, fast_paths, keys, slots, waiting

    names: dict[int, str] = {id(RAW_TAKE): "RAW_TAKE", id(RAW_GIVE): "RAW_GIVE"}
    for module in (fast_paths, books, claims, keys, slots, waiting):
        for attr, value in vars(module).items():
            if isinstance(value, sa.TextClause):
                names[id(value)] = f"{module.__name__.rsplit('.', 1)[1]}.{attr}"
    return names


def profile(url: str, cycles: int = 300) -> list[str]:
    """One client, no contention: the statements per claim and per release, and their mean time."""
    names = _statement_names()
    engine = sa.create_engine(url, pool_size=1, max_overflow=0)
    timings: dict[tuple[str, str], list[float]] = defaultdict(list)
    phase = ["-"]
    pending: dict[int, float] = {}

    @sa.event.listens_for(engine, "before_cursor_execute")
    def before(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        pending[id(cursor)] = time.perf_counter()

    @sa.event.listens_for(engine, "after_cursor_execute")
    def after(conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        elapsed = time.perf_counter() - pending.pop(id(cursor), time.perf_counter())
        compiled = getattr(context, "compiled", None)
        clause = getattr(compiled, "statement", None)
        label = names.get(id(clause), statement.split()[0] if statement else "?")
        timings[(phase[0], label)].append(elapsed)

    driver = Driver(engine, 0, 1)
    # Transactions (BEGIN … COMMIT) per phase: the fast paths run in autocommit and open none.
    transactions: dict[str, int] = defaultdict(int)
    in_transaction = driver.ledger.transaction

    def counted_transaction(work: Any, **kw: Any) -> Any:
        transactions[phase[0]] += 1
        return in_transaction(work, **kw)

    driver.ledger.transaction = counted_transaction  # type: ignore[method-assign]
    lines: list[str] = []
    try:
        for scenario_name, key in (("mutex", "acct:profile"), ("gate1", "gate1:stripe"), ("gate8", "gate8:stripe")):
            for _ in range(20):  # warm: psycopg prepares a statement after 5 executions
                driver.ledger_cycle(key)
            timings.clear()
            transactions.clear()
            totals = {"claim": 0.0, "release": 0.0}
            for _ in range(cycles):
                driver.seq += 1
                task_id = f"{driver.prefix}-{driver.seq}"
                phase[0] = "claim"
                t0 = time.perf_counter()
                adm = driver.ledger.admit(Arrival(task_id=task_id, key=key))
                t1 = time.perf_counter()
                phase[0] = "release"
                driver.ledger.release(Token(task_id, 0), adm.fence or 0, Outcome.COMPLETED)
                t2 = time.perf_counter()
                totals["claim"] += t1 - t0
                totals["release"] += t2 - t1
            lines.append(f"{scenario_name} ({key}), 1 client, {cycles} cycles:")
            for ph in ("claim", "release"):
                entries = [(label, ts) for (p, label), ts in timings.items() if p == ph]
                per = sum(len(ts) for _, ts in entries) / cycles
                in_sql = sum(sum(ts) for _, ts in entries) / cycles * 1000
                whole = totals[ph] / cycles * 1000
                tx = transactions[ph] / cycles
                lines.append(f"  {ph}: {per:.2f} statements, {tx:.2f} transactions (BEGIN + COMMIT) per {ph}; "
                             f"{whole:.3f} ms per {ph}, of which {in_sql:.3f} ms in statements")
                for label, ts in sorted(entries, key=lambda e: -sum(e[1])):
                    lines.append(f"    {label:<36} {len(ts) / cycles:4.1f}x  {statistics.mean(ts) * 1000:7.3f} ms")
        phase[0] = "raw"
        timings.clear()
        t0 = time.perf_counter()
        for _ in range(cycles):
            driver.raw_cycle(1)
        whole = (time.perf_counter() - t0) / cycles / 2 * 1000
        raw = timings[("raw", "RAW_TAKE")] + timings[("raw", "RAW_GIVE")]
        lines.append(f"raw two-commit single row, 1 client: 1 statement + BEGIN + COMMIT per transaction; "
                     f"{whole:.3f} ms per transaction, {statistics.mean(raw) * 1000:.3f} ms in the UPDATE")
        timings.clear()
        t0 = time.perf_counter()
        for _ in range(cycles):
            driver.raw_autocommit_cycle(1)
        whole = (time.perf_counter() - t0) / cycles / 2 * 1000
        raw = timings[("raw", "RAW_TAKE")] + timings[("raw", "RAW_GIVE")]
        lines.append(f"raw autocommit single row, 1 client: 1 self-committing statement; "
                     f"{whole:.3f} ms per statement, {statistics.mean(raw) * 1000:.3f} ms in the UPDATE")
    finally:
        engine.dispose()
    return lines


def hot_path(url: str, samples: int = 300) -> list[str]:
    """One client on one mutex key: the latency of a park (an arrival while the key is held) and of the
    release-and-promote that hands the key to it (bound by its nonce afterwards, untimed), alternately with and
    without ``contended``; p50 / p99 against the targets (≤ 2 ms p50)."""
    engine = sa.create_engine(url, pool_size=1, max_overflow=0)
    ledger = Ledger(engine, lease=60)
    prefix = f"hot-{uuid.uuid4().hex[:8]}"
    key = f"acct:{prefix}"
    park: list[float] = []
    handoff: dict[bool, list[float]] = {False: [], True: []}
    try:
        holder = ledger.admit(Arrival(task_id=f"{prefix}-0", key=key))
        token, fence = Token(f"{prefix}-0", 0), holder.fence or 0
        for i in range(1, samples + 21):
            arrival = Arrival(task_id=f"{prefix}-{i}", key=key)
            started = time.perf_counter()
            admission = ledger.admit(arrival)
            parked_in = time.perf_counter() - started
            if admission.verdict is not Verdict.PARKED:
                raise RuntimeError(f"hot path: the arrival was not parked: {admission}")
            contended = bool(i % 2)
            started = time.perf_counter()
            report = ledger.release(token, fence, Outcome.COMPLETED, contended=contended)
            promoted_in = time.perf_counter() - started
            if len(report.promotions) != 1 or report.promotions[0].nonce is None:
                raise RuntimeError(f"hot path: the release did not promote the parked arrival: {report}")
            promotion = report.promotions[0]
            nonce = promotion.nonce
            if nonce is None:  # checked above; for the type checker
                raise RuntimeError(f"hot path: the promotion has no nonce: {report}")
            fence = ledger.bind(promotion.token, nonce) or 0
            token = promotion.token
            if i > 20:  # warm: psycopg prepares a statement after 5 executions
                park.append(parked_in)
                handoff[contended].append(promoted_in)
        ledger.release(token, fence, Outcome.COMPLETED)
    finally:
        engine.dispose()

    def p(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0

    return [
        f"  park: p50 {p(park, 0.5):.2f} ms, p99 {p(park, 0.99):.2f} ms (target p50 ≤ 2 ms; fast claim + "
        "keyed_admit_plain)",
        *(
            f"  release-and-promote{' (contended: one transaction)' if c else ' (uncontended)'}: "
            f"p50 {p(handoff[c], 0.5):.2f} ms, p99 {p(handoff[c], 0.99):.2f} ms (target p50 ≤ 2 ms; "
            "keyed_release_many + keyed_promote_plain)"
            for c in (True, False)
        ),
    ]


# -- main ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ledger", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per scenario (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each (default 1)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; medians reported")
    parser.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    parser.add_argument("--no-profile", action="store_true", help="skip the single-client statement profile")
    args = parser.parse_args(argv)

    started = time.monotonic()
    measures = {s.name: Measure() for s in SCENARIOS}
    with bench_database() as (url, server):
        print(f"server: {server}; {args.clients} clients; {args.rounds} round(s) of "
              f"{args.warmup:g} s warm-up + {args.seconds:g} s per scenario", flush=True)
        engine = sa.create_engine(url, pool_size=1, max_overflow=0)
        clients = Clients(url, args.clients)
        try:
            for r in range(args.rounds):
                for scenario in SCENARIOS:
                    rate, latencies, wal, statements = clients.run(engine, scenario.name, args.warmup, args.seconds)
                    m = measures[scenario.name]
                    m.rates.append(rate)
                    m.latencies += latencies
                    m.wal.append(wal)
                    m.statements.append(statements)
                    print(f"  round {r + 1}: {scenario.label:<46} {rate:8.0f} cycles/s", flush=True)
        finally:
            clients.close()
            engine.dispose()
        lines = [] if args.no_profile else profile(url)
        hot = hot_path(url)

    print()
    print(table(measures, args.rounds))
    if lines:
        print()
        print("Profile (single client, no contention):")
        print("\n".join(lines))
    print()
    print("Hot path (single client, one mutex key):")
    print("\n".join(hot))
    print(f"\n(total {time.monotonic() - started:.0f} s)")
    return 0


def table(measures: dict[str, Measure], rounds: int) -> str:
    """The results as a Markdown table, then the ratios against their targets."""
    rows = ["| scenario | cycles/s | p50 claim ms | p99 claim ms | statements per claim / release | WAL B/cycle "
            "| ratio vs raw two-commit | ratio vs raw autocommit |",
            "|---|---:|---:|---:|---:|---:|---|---|"]
    for s in SCENARIOS:
        m = measures[s.name]
        spread = f" ({min(m.rates):.0f}-{max(m.rates):.0f})" if rounds > 1 else ""
        ratio = ""
        if s.name in BASELINE:
            cells = []
            for baselines in (BASELINE, BASELINE_AUTOCOMMIT):
                base = baselines[s.name]
                rows_touched = "1,000 rows" if base.endswith("1000") else "single row"
                cells.append(f"{m.rate / measures[base].rate:.2f} vs {rows_touched} (target ≥ 0.7)")
            ratio = " | ".join(cells)
        else:
            ratio = " | "
        if s.kind == "ledger":
            claim = statistics.mean(x["claim"] for x in m.statements)
            release = statistics.mean(x["release"] for x in m.statements)
            sent = f"{claim:.2f} / {release:.2f}"
        else:
            sent = "1 / 1"
        rows.append(f"| {s.label} | {m.rate:.0f}{spread} | {m.percentile(0.50):.2f} | {m.percentile(0.99):.2f} "
                    f"| {sent} | {statistics.median(m.wal):.0f} | {ratio} |")
    g1, g8 = measures["gate1"], measures["gate8"]
    multi, mutex, batch = measures["multi"], measures["mutex"], measures["batch8"]
    rows.append("")
    rows.append(
        f"batch of {BATCH} vs the unbatched mutex cycle: {BATCH * batch.rate / mutex.rate:.2f}x claim+release "
        f"cycles/s ({BATCH} x {batch.rate:.0f} batches/s vs {mutex.rate:.0f}; target ≥ 3x); statements per batch "
        f"{statistics.mean(x['claim'] for x in batch.statements):.2f} admit_many / "
        f"{statistics.mean(x['release'] for x in batch.statements):.2f} release_many"
    )
    rows.append(
        f"multi-key (2 keys per claim) vs single-key, 1,000 keys: {multi.rate / mutex.rate:.2f}x throughput; "
        f"statements per claim {statistics.mean(x['claim'] for x in multi.statements):.2f} vs "
        f"{statistics.mean(x['claim'] for x in mutex.statements):.2f} (target: at most one extra round trip)"
    )
    rows.append(f"hot gate, 8 shards vs 1 shard: {g8.rate / g1.rate:.2f}x throughput (target ≥ 1.25x); "
                f"p99 claim {g8.percentile(0.99):.2f} ms vs {g1.percentile(0.99):.2f} ms")
    if rounds > 1:
        per_round = [a / b for a, b in zip(g8.rates, g1.rates, strict=True)]
        rows.append(f"  per round: {', '.join(f'{x:.2f}' for x in per_round)}")
        for baselines in (BASELINE, BASELINE_AUTOCOMMIT):
            for name, base in baselines.items():
                each = [a / b for a, b in zip(measures[name].rates, measures[base].rates, strict=True)]
                rows.append(f"  {name} vs {base} per round: {', '.join(f'{x:.2f}' for x in each)}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
