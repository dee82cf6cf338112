"""Scale: what no other benchmark measures yet (DESIGN §8), side by side in one run.

    python -m bench.scale [--quick] [--only promotion,memory,shards] [--parked 1000000] [--small 100]

1. **Promotion latency, 1,000,000 parked attempts vs 100** (target ≤ 2x). Two databases on one durable server:
   one with ``--small`` parked attempts in all, one with ``--parked``. Both are filled by the same filler: bulk
   ``INSERT ... SELECT generate_series`` into the ledger's own tables, writing the rows ``Ledger.admit`` writes
   when it parks (a ``keyed_tasks`` row per task id, a ``keyed_waiting`` row with a number from
   ``keyed_arrival_seq``, a ``keyed_keys`` head row whose ``waiting`` counts them, a ``keyed_slots`` row per
   key); reconcile's counter check (``check_counters_once``) and ``Ledger.books()`` then confirm the books.
   The filler keys belong to a paused name (``fill``, limit 0), so they can never start; 1 in 10 of their rows
   is also not yet due (``not_before`` a day ahead). The parked rows are spread over many keys, and many stand
   behind one key. Measured keys (name ``meas``, K = 1, its slot held by a real claim of the benchmark):
   ``meas:0`` with 10 real parked attempts behind it in both databases, and in the large one also
   ``meas:deep`` with 10 % of the parked rows behind it (1 in 10 of them not yet due). A cycle: release the
   running claim (``Ledger.release(..., contended=True)``: the release and its promotion in one transaction,
   as the gate does for a key that parked recently), timed; then bind the promoted attempt (it is the next
   running claim) and admit one more arrival, which parks at the tail (the line keeps its length). The
   lines are cycled in turn, one cycle each, so they share the machine's noise. Then EXPLAIN (ANALYZE,
   BUFFERS) of the promotion's statements (and the sweep's) on the large database: which index they use.
2. **Worker memory, 100,000 parked attempts vs none** (target: flat). A real ``celery worker -P prefork``
   with the gate (bench.gate's app, variant B) on an empty ledger, then on one with ``--memory-parked``
   filler rows plus a few real parks (tasks published on a paused key: the worker parks them), alternating
   ``--memory-pairs`` times. RSS (psutil: the main process and its pool children) after the worker has swept
   for ``--sweep-seconds``.
3. **Hot gate, 8 shards vs 1 shard** (target ≥ 1.25x): bench.ledger's own measure (``Clients.run``, its 4
   client processes, K = 100, claim + release cycles), run ``--rounds`` times interleaved (ABBA), median and
   min-max of the per-round ratios, p99 claim latency.

A run holds ``flock $HOME/.celery-keyed-bench.lock`` (the command re-executes itself under ``flock``) and
records the load average before and after. Benchmarks are not tests: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from bench.procs import run_locked
from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict, migrate

SMOKE = "Smoke, machine shared: not evidence"

FILL_NAME = "fill"  # paused (limit 0): its parked attempts never start
MEAS_NAME = "meas"
NAMES = {FILL_NAME: NameConfig(FILL_NAME, limit=0), MEAS_NAME: NameConfig(MEAS_NAME, limit=1)}
NOT_DUE_EVERY = 10  # 1 filler row in 10 has a not-before time a day ahead
SHALLOW = 10  # real parked attempts behind meas:0
MESSAGE_PAD = 200  # bytes of padding in a filler message (a small Celery message)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- servers and databases ---------------------------------------------------------------------------------------


@dataclass
class Server:
    url: str  # SQLAlchemy URL of the server's default database
    admin: str  # libpq URL, for CREATE / DROP DATABASE
    target: Any
    made: list[str] = field(default_factory=list)

    def database(self, tag: str) -> str:
        """A new migrated database with the benchmark's names configured; its SQLAlchemy URL."""
        name = f"keyed_scale_{tag}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(self.admin, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        self.made.append(name)
        url = self.target.url_for(name)
        engine = sa.create_engine(url)
        try:
            migrate(engine)
            Ledger(engine).configure(NAMES)
        finally:
            engine.dispose()
        return url

    def drop_all(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as admin:
            for name in self.made:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def server() -> Iterator[tuple[Server, str]]:
    from celery_keyed.testing import start_postgres

    with start_postgres(durable=True) as pg:
        admin = make_url(pg.url).set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(admin, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()
            fsync = conn.execute("SHOW fsync").fetchone()
            buffers = conn.execute("SHOW shared_buffers").fetchone()
        described = (f"PostgreSQL {version[0] if version else '?'} (fsync={fsync[0] if fsync else '?'}, "
                     f"shared_buffers={buffers[0] if buffers else '?'}, "
                     f"{'started by the benchmark' if pg.managed else 'KEYED_DATABASE_URL'})")
        srv = Server(pg.url, admin, pg)
        try:
            yield srv, described
        finally:
            srv.drop_all()


# -- the filler: the rows Ledger.admit writes when it parks, in bulk ----------------------------------------------

_FILL_TASKS = sa.text(
    """
    INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at)
    SELECT :prefix || g, 'bench.fill', {key}, NULL, now()
      FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g
    """
)
_FILL_WAITING = sa.text(
    """
    INSERT INTO keyed_waiting (task_id, attempt, key, group_key, group_seq, priority, arrival, arrived_at,
                               not_before, deadline, supersede_key, shadow, group_blocked, queue, message, keys,
                               cost, reserved_keys, reserved_shards, reserved_at, fair_key)
    SELECT :prefix || g, 0, {key}, NULL, NULL, 0, nextval('keyed_arrival_seq'), now(),
           CASE WHEN g % CAST(:not_due_every AS bigint) = 0 THEN now() + interval '1 day' END, NULL, NULL, false,
           false, 'celery',
           jsonb_build_object('task', 'bench.fill', 'id', :prefix || g, 'args', jsonb_build_array(g),
                              'kwargs', '{}'::jsonb,
                              'headers', jsonb_build_object('pad', repeat('x', CAST(:pad AS integer)))),
           NULL, 1, NULL, NULL, NULL, NULL
      FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g ORDER BY g
    """
)
# The head rows and slot rows of the filled keys, and their waiting counters (added to what real parks counted).
_FILL_KEYS = sa.text(
    """
    INSERT INTO keyed_keys (key, name, waiting, active_at)
    SELECT key, split_part(key, ':', 1), count(*), now() FROM keyed_waiting
     WHERE task_id LIKE :prefix || '%' GROUP BY key
    ON CONFLICT (key) DO UPDATE SET waiting = keyed_keys.waiting + excluded.waiting
    """
)
_FILL_SLOTS = sa.text(
    """
    INSERT INTO keyed_slots (key, shard, name, used)
    SELECT DISTINCT key, 0, split_part(key, ':', 1), 0 FROM keyed_waiting WHERE task_id LIKE :prefix || '%'
    ON CONFLICT (key, shard) DO NOTHING
    """
)


def fill(engine: sa.Engine, segments: list[tuple[str, int]], *, chunk: int = 100_000) -> float:
    """Park filler attempts in bulk: ``segments`` = (SQL expression of ``g`` giving the key, rows). Returns the
    seconds it took (then VACUUM ANALYZE, as autovacuum would have done on a ledger that grew this large)."""
    started = time.monotonic()
    prefix = f"fill-{uuid.uuid4().hex[:6]}-"
    lo = 1
    with engine.begin() as conn:
        for key_sql, rows in segments:
            for start in range(lo, lo + rows, chunk):
                params = {"prefix": prefix, "lo": start, "hi": min(lo + rows, start + chunk) - 1,
                          "not_due_every": NOT_DUE_EVERY, "pad": MESSAGE_PAD}
                conn.execute(sa.text(_FILL_TASKS.text.replace("{key}", key_sql)), params)
                conn.execute(sa.text(_FILL_WAITING.text.replace("{key}", key_sql)), params)
            lo += rows
        conn.execute(_FILL_KEYS, {"prefix": prefix})
        conn.execute(_FILL_SLOTS, {"prefix": prefix})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE keyed_waiting, keyed_tasks, keyed_keys, keyed_slots"))
    return time.monotonic() - started


def spread_key(keys: int) -> str:
    return f"'{FILL_NAME}:' || (g % {keys})"


def check_books(engine: sa.Engine) -> tuple[int, int, list[str]]:
    """(parked rows, sum of keyed_keys.waiting, reconcile's drift messages without repairing)."""
    from celery_keyed.ledger import check_counters_once

    with engine.connect() as conn:
        parked = int(conn.execute(sa.text("SELECT count(*) FROM keyed_waiting")).scalar_one())
        counted = int(conn.execute(sa.text("SELECT COALESCE(sum(waiting), 0) FROM keyed_keys")).scalar_one())
    return parked, counted, check_counters_once(engine, repair=False)


# -- 1. promotion latency ----------------------------------------------------------------------------------------


class Line:
    """One measured key (K = 1): a running claim of the benchmark and ``behind`` attempts parked behind it."""

    def __init__(self, label: str, ledger: Ledger, key: str) -> None:
        self.label, self.ledger, self.key = label, ledger, key
        self.prefix = f"{key}-{uuid.uuid4().hex[:6]}-"
        self.seq = 0
        self.latencies: list[float] = []
        self.token: Token | None = None
        self.fence = 0

    def arrive(self) -> Verdict:
        self.seq += 1
        task_id = f"{self.prefix}{self.seq}"
        admission = self.ledger.admit(Arrival(task_id=task_id, key=self.key, task_name="bench.hold", queue="celery",
                                              message={"task": "bench.hold", "id": task_id, "args": [self.seq]}))
        if admission.verdict is Verdict.ADMITTED:
            self.token, self.fence = Token(task_id, 0), int(admission.fence or 0)
        return admission.verdict

    def start(self, behind: int) -> None:
        if self.arrive() is not Verdict.ADMITTED:
            raise RuntimeError(f"{self.key}: the first arrival did not get the slot")
        for _ in range(behind):
            if self.arrive() is not Verdict.PARKED:
                raise RuntimeError(f"{self.key}: an arrival behind the running claim did not park")

    def cycle(self, record: bool = True) -> None:
        """Release the running claim (timed: the release and the promotion it makes), bind the promoted
        attempt, park one more at the tail."""
        assert self.token is not None
        started = time.perf_counter()
        report = self.ledger.release(self.token, self.fence, Outcome.COMPLETED, contended=True)
        elapsed = time.perf_counter() - started
        if not report.released or len(report.promotions) != 1 or report.promotions[0].nonce is None:
            raise RuntimeError(f"{self.key}: release promoted {report.promotions!r}")
        promoted = report.promotions[0]
        token = Token(promoted.task_id, promoted.attempt)
        fence = self.ledger.bind(token, promoted.nonce)  # type: ignore[arg-type]
        if fence is None:
            raise RuntimeError(f"{self.key}: the promotion of {token} did not bind")
        self.token, self.fence = token, fence
        if self.arrive() is not Verdict.PARKED:
            raise RuntimeError(f"{self.key}: the tail arrival did not park")
        if record:
            self.latencies.append(elapsed)


#: The statements a release's promotion sends (promote.promote_waiters), and the sweep's scans of the waiting room.
def _explained() -> list[tuple[str, Any, dict[str, Any]]]:
    from celery_keyed.ledger import keys, waiting

    return [
        ("promotion: waiting.WAITING_NEXT_FOR_KEY", waiting.WAITING_NEXT_FOR_KEY, {"limit": 4}),
        ("promotion: waiting.WAITING_CLEAR_DUE_FOR_KEY", waiting.WAITING_CLEAR_DUE_FOR_KEY, {"name": MEAS_NAME}),
        ("release: keys.KEYS_GET_WAITING", keys.KEYS_GET_WAITING, {}),
        ("claim fast path: fast_paths.CLAIM_NEW's NOT EXISTS (waiting.WAITING_PROMOTABLE_EXISTS)",
         waiting.WAITING_PROMOTABLE_EXISTS, {}),
        ("sweep: waiting.WAITING_KEYS_PROMOTABLE", waiting.WAITING_KEYS_PROMOTABLE, {"limit": 10_000}),
        ("sweep: waiting.WAITING_ORPHAN_SHADOWS", waiting.WAITING_ORPHAN_SHADOWS, {"batch": 500}),
        ("sweep: waiting.WAITING_MULTI_PROMOTABLE", waiting.WAITING_MULTI_PROMOTABLE, {"limit": 1_000}),
        ("sweep: waiting.WAITING_CLEAR_DUE", waiting.WAITING_CLEAR_DUE, {"batch": 500}),
        ("sweep: waiting.WAITING_DELETE_EXPIRED", waiting.WAITING_DELETE_EXPIRED, {"batch": 1}),
    ]


def _generic(statement: str, params: dict[str, Any]) -> tuple[str, str, list[Any]]:
    """PREPARE / EXECUTE text for ``statement`` (named binds → $n), to EXPLAIN its generic plan too: after five
    executions psycopg prepares a statement, and PostgreSQL may then use a plan made without the values."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    text = re.sub(r"(?<!:):([a-z_]+)", number, statement)
    types = {"now": "timestamptz", "limit": "integer", "batch": "integer"}
    decl = ", ".join(types.get(name, "text") for name in order)
    return text, decl, [params[name] for name in order]


def explain(url: str, keys: list[str]) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the promotion's statements for each key, and of the sweep's scans; each in a
    transaction that is rolled back (the custom plan, then the generic one for the key-bound statements)."""
    engine = sa.create_engine(url, pool_size=1, max_overflow=0)
    out: list[str] = []
    try:
        for label, clause, extra in _explained():
            bound = ":key" in clause.text
            for key in keys if bound else [None]:
                params = {"now": None, "key": key, **extra}
                for mode in ("custom", "generic") if bound else ("custom",):
                    with engine.connect() as conn:
                        tx = conn.begin()
                        try:
                            if mode == "custom":
                                rows = conn.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS) " + clause.text), params)
                            else:
                                text, decl, values = _generic(clause.text, params)
                                conn.execute(sa.text("SET LOCAL plan_cache_mode = force_generic_plan"))
                                conn.exec_driver_sql(f"PREPARE bench_scale_p ({decl}) AS {text}")
                                args = ", ".join("NULL" if v is None else f"'{v}'" for v in values)
                                rows = conn.exec_driver_sql(
                                    f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_scale_p ({args})")
                            plan = [r[0] for r in rows]
                        finally:
                            tx.rollback()
                            if mode == "generic":
                                conn.exec_driver_sql("DEALLOCATE ALL")
                    where = f" key={key}" if key else ""
                    out.append(f"-- {label}{where} ({mode} plan)")
                    out += [f"   {line}" for line in plan]
    finally:
        engine.dispose()
    return out


def uses_index(plan_lines: list[str]) -> str:
    scans = [m.group(0) for line in plan_lines for m in re.finditer(r"(Index Only Scan|Index Scan|Bitmap Index Scan|"
                                                                     r"Seq Scan)( using \w+)?( on \w+)?", line)]
    return "; ".join(dict.fromkeys(scans)) or "?"


@dataclass
class PromotionResult:
    lines: list[Line]
    fills: dict[str, float]
    books: dict[str, tuple[int, int, list[str]]]
    plans: list[str]
    load: tuple[str, str]
    sweeps: dict[str, float] = field(default_factory=dict)


def promotion(srv: Server, *, parked: int, small: int, cycles: int, warmup: int, spread_keys: int,
              deep_share: float, explain_plans: bool = True) -> PromotionResult:
    load0 = load()
    urls = {"small": srv.database("small"), "large": srv.database("large")}
    engines = {n: sa.create_engine(u, pool_size=2, max_overflow=0) for n, u in urls.items()}
    try:
        ledgers = {n: Ledger(e, lease=3600) for n, e in engines.items()}
        lines = [Line(f"{small:,} parked, meas:0 ({SHALLOW} behind it)", ledgers["small"], f"{MEAS_NAME}:0"),
                 Line(f"{parked:,} parked, meas:0 ({SHALLOW} behind it)", ledgers["large"], f"{MEAS_NAME}:0")]
        deep = max(1, int(parked * deep_share))
        deep_line = Line(f"{parked:,} parked, meas:deep ({deep:,} behind it)", ledgers["large"], f"{MEAS_NAME}:deep")
        lines.append(deep_line)
        for line in lines:
            line.start(SHALLOW if line is not deep_line else 0)
        fills = {}
        print(f"  filling: small {small:,}, large {parked:,} parked attempts ...", flush=True)
        fills["small"] = fill(engines["small"], [(spread_key(max(1, min(spread_keys, small // 10))),
                                                 small - SHALLOW)])
        fills["large"] = fill(engines["large"], [(f"'{MEAS_NAME}:deep'", deep),
                                                 (spread_key(spread_keys), parked - SHALLOW - deep)])
        print(f"  filled in {fills['small']:.1f} s / {fills['large']:.1f} s; checking the books ...", flush=True)
        books = {n: check_books(e) for n, e in engines.items()}
        for n, (rows, counted, drift) in books.items():
            if drift or rows != counted:
                raise RuntimeError(f"{n}: the filled ledger's books do not balance: {rows} rows, "
                                   f"waiting {counted}, drift {drift[:5]}")
        for _ in range(warmup):
            for line in lines:
                line.cycle(record=False)
        for _ in range(cycles):
            for line in lines:
                line.cycle()
        sweeps = {}
        for n, ledger in ledgers.items():  # one sweep, as every worker runs each keyed_sweep_interval (D2)
            t0 = time.perf_counter()
            ledger.sweep()
            sweeps[n] = time.perf_counter() - t0
        plans = explain(urls["large"], [f"{MEAS_NAME}:0", f"{MEAS_NAME}:deep"]) if explain_plans else []
        after = {n: check_books(e) for n, e in engines.items()}
        for n, (rows, counted, drift) in after.items():
            if drift or rows != counted:
                raise RuntimeError(f"{n}: the books do not balance after the cycles: {drift[:5]}")
        return PromotionResult(lines, fills, books, plans, (load0, load()), sweeps)
    finally:
        for e in engines.values():
            e.dispose()


def promotion_table(result: PromotionResult) -> list[str]:
    base = result.lines[0]
    b50, b99 = pct(base.latencies, 0.5), pct(base.latencies, 0.99)
    rows = ["| line | cycles | p50 ms | p99 ms | p50 vs the small ledger | p99 vs the small ledger |",
            "|---|---:|---:|---:|---:|---:|"]
    for line in result.lines:
        p50, p99 = pct(line.latencies, 0.5), pct(line.latencies, 0.99)
        rows.append(f"| {line.label} | {len(line.latencies)} | {p50 * 1000:.2f} | {p99 * 1000:.2f} "
                    f"| {p50 / b50:.2f}x | {p99 / b99:.2f}x |")
    rows.append("")
    rows.append("target: promotion latency with 1,000,000 parked vs 100 ≤ 2x (release → promotion, one "
                "transaction; lines cycled in turn)")
    rows.append(f"filled in {result.fills['small']:.1f} s / {result.fills['large']:.1f} s; books after filling "
                f"(parked rows = sum of keyed_keys.waiting, reconcile drift): "
                + "; ".join(f"{n} {r:,} = {c:,}, drift {len(d)}" for n, (r, c, d) in result.books.items()))
    if result.sweeps:
        small, large = result.sweeps["small"], result.sweeps["large"]
        rows.append(f"one Ledger.sweep() (what every worker runs each keyed_sweep_interval): {small * 1000:.0f} ms on "
                    f"the small ledger, {large * 1000:.0f} ms on the large one ({large / small:.0f}x; not a "
                    f"DESIGN §8 target: the sweep's scans are EXPLAINed below)")
    return rows


# -- 2. worker memory --------------------------------------------------------------------------------------------


def rss(pid: int) -> tuple[int, int, int]:
    """(main RSS, main + children RSS, main + children USS) in bytes."""
    import psutil

    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    main = proc.memory_info().rss
    total = uss = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
            uss += p.memory_full_info().uss
    return main, total, uss


@dataclass
class MemoryRun:
    variant: str
    parked: int
    main: int
    total: int
    uss: int
    children: int
    real_parked: int


def memory(srv: Server, *, parked: int, pairs: int, sweep_seconds: float, spread_keys: int,
           real_parks: int) -> tuple[list[MemoryRun], tuple[str, str]]:
    from bench.gate.harness import Bench, Worker
    from celery_keyed.testing import start_redis

    load0 = load()
    runs: list[MemoryRun] = []
    urls = {"empty": srv.database("mem_empty"), "parked": srv.database("mem_parked")}
    engine = sa.create_engine(urls["parked"], pool_size=1, max_overflow=0)
    try:
        print(f"  filling: {parked:,} parked attempts for the worker ...", flush=True)
        seconds = fill(engine, [(f"'{FILL_NAME}:deep'", parked // 10),
                                (spread_key(spread_keys), parked - parked // 10)])
        print(f"  filled in {seconds:.1f} s", flush=True)
    finally:
        engine.dispose()
    with start_redis() as rd, tempfile.TemporaryDirectory(prefix="bench-scale-") as logs:
        import redis

        client = redis.Redis.from_url(rd.url)
        for i in range(pairs):
            for variant in ("empty", "parked") if i % 2 == 0 else ("parked", "empty"):
                bench = Bench(rd.url, urls[variant], client, Path(logs))
                queue = bench.tag(f"q-{variant}")
                worker = Worker.start(bench, "keyed", queue, f"scale-{variant}-{i}", 2)
                try:
                    _wait_ready(bench, worker)
                    real = 0
                    if variant == "parked":  # a few real parks: tasks of a paused key, parked by the worker
                        bench.publish("keyed", "hold", queue,
                                      [(bench.tag("obs"), f"{FILL_NAME}:real", 0.0) for _ in range(real_parks)])
                    deadline = time.monotonic() + sweep_seconds
                    while time.monotonic() < deadline:
                        worker.check()
                        time.sleep(0.5)
                    if variant == "parked":
                        with bench.ledger.connect() as conn:
                            real = int(conn.execute(sa.text("SELECT count(*) FROM keyed_waiting WHERE key = :k"),
                                                    {"k": f"{FILL_NAME}:real"}).scalar_one())
                    main, total, uss = rss(worker.proc.pid)
                    import psutil

                    children = len(psutil.Process(worker.proc.pid).children(recursive=True))
                    with bench.ledger.connect() as conn:
                        count = int(conn.execute(sa.text("SELECT count(*) FROM keyed_waiting")).scalar_one())
                    runs.append(MemoryRun(variant, count, main, total, uss, children, real))
                    print(f"    {variant:<6} pair {i + 1}: {count:>9,} parked, RSS main {main / 2**20:.1f} MiB, "
                          f"main + {children} children {total / 2**20:.1f} MiB", flush=True)
                finally:
                    worker.stop()
                    if bench._ledger is not None:
                        bench._ledger.dispose()
    return runs, (load0, load())


def _wait_ready(bench: Any, worker: Any, timeout: float = 90.0) -> None:
    from bench.gate.worker_app import READY_LIST

    deadline = time.monotonic() + timeout
    while worker.hostname.encode() not in bench.redis.lrange(READY_LIST, 0, -1):
        worker.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker not ready:\n{worker.tail()}")
        time.sleep(0.1)


def memory_table(runs: list[MemoryRun], sweep_seconds: float) -> list[str]:
    def med(variant: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in runs if r.variant == variant) / 2**20

    def span(variant: str, attr: str) -> str:
        values = [getattr(r, attr) / 2**20 for r in runs if r.variant == variant]
        return f"{min(values):.1f}-{max(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"

    rows = ["| ledger | parked | runs | RSS main MiB | RSS main + pool MiB | USS main + pool MiB |",
            "|---|---:|---:|---:|---:|---:|"]
    for variant in ("empty", "parked"):
        these = [r for r in runs if r.variant == variant]
        rows.append(f"| {variant} | {max(r.parked for r in these):,} | {len(these)} "
                    f"| {med(variant, 'main'):.1f} ({span(variant, 'main')}) "
                    f"| {med(variant, 'total'):.1f} ({span(variant, 'total')}) "
                    f"| {med(variant, 'uss'):.1f} ({span(variant, 'uss')}) |")
    rows.append("")
    real = max((r.real_parked for r in runs if r.variant == "parked"), default=0)
    rows.append(f"parked vs empty (medians): RSS main {med('parked', 'main') / med('empty', 'main'):.2f}x, "
                f"main + pool {med('parked', 'total') / med('empty', 'total'):.2f}x, "
                f"USS {med('parked', 'uss') / med('empty', 'uss'):.2f}x (target: flat); after {sweep_seconds:g} s "
                f"of sweeping (keyed_sweep_interval 1 s); {real} of the parked attempts parked by the worker itself")
    return rows


# -- 3. hot gate shards -----------------------------------------------------------------------------------------


def shards(
    srv: Server, *, rounds: int, seconds: float, warmup: float, clients: int
) -> tuple[list[str], tuple[str, str]]:
    from bench import ledger as bl

    load0 = load()
    url = srv.database("shards")
    engine = sa.create_engine(url, pool_size=1, max_overflow=0)
    Ledger(engine).configure(bl.NAMES)
    measures = {"gate1": bl.Measure(), "gate8": bl.Measure()}
    pool = bl.Clients(url, clients)
    try:
        for r in range(rounds):
            order = ("gate1", "gate8") if r % 2 == 0 else ("gate8", "gate1")
            for name in order:
                rate, latencies, _, _ = pool.run(engine, name, warmup, seconds)
                measures[name].rates.append(rate)
                measures[name].latencies += latencies
                measures[name].wal.append(0.0)
                print(f"    round {r + 1}: {bl.BY_NAME[name].label:<38} {rate:7.0f} cycles/s", flush=True)
    finally:
        pool.close()
        engine.dispose()
    g1, g8 = measures["gate1"], measures["gate8"]
    per_round = [a / b for a, b in zip(g8.rates, g1.rates, strict=True)]
    rows = ["| gate | cycles/s median (min-max) | p50 claim ms | p99 claim ms |", "|---|---:|---:|---:|"]
    for name, m in measures.items():
        rows.append(f"| {bl.BY_NAME[name].label} | {m.rate:.0f} ({min(m.rates):.0f}-{max(m.rates):.0f}) "
                    f"| {m.percentile(0.5):.2f} | {m.percentile(0.99):.2f} |")
    rows.append("")
    rows.append(f"8 shards vs 1 shard: {statistics.median(per_round):.2f}x throughput, median of {rounds} interleaved "
                f"rounds (spread {min(per_round):.2f}-{max(per_round):.2f}; per round "
                f"{', '.join(f'{x:.2f}' for x in per_round)}; target ≥ 1.25x); p99 claim "
                f"{g8.percentile(0.99):.2f} ms vs {g1.percentile(0.99):.2f} ms; {clients} client processes, "
                f"K = {bl.GATE_LIMIT}, {warmup:g} s warm-up + {seconds:g} s per run")
    return rows, (load0, load())


# -- main --------------------------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cycles, rounds and pairs (same ledger sizes)")
    parser.add_argument("--only", default="promotion,memory,shards", help="sections to run (comma-separated)")
    parser.add_argument("--parked", type=int, default=1_000_000, help="parked attempts of the large ledger")
    parser.add_argument("--small", type=int, default=100, help="parked attempts of the small ledger")
    parser.add_argument("--spread-keys", type=int, default=10_000, help="filler keys the parked rows spread over")
    parser.add_argument("--cycles", type=int, help="measured promotions per line (default 300, quick 100)")
    parser.add_argument("--memory-parked", type=int, default=100_000, help="parked attempts for the worker")
    parser.add_argument("--memory-pairs", type=int, help="empty/parked worker pairs (default 2, quick 1)")
    parser.add_argument("--sweep-seconds", type=float, help="seconds a worker sweeps before RSS (default 30, quick 10)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the shards comparison (default 6, quick 5)")
    parser.add_argument("--seconds", type=float, help="measured seconds per shards run (default 5, quick 2)")
    parser.add_argument("--no-explain", action="store_true", help="skip the EXPLAIN output")
    parser.add_argument("--lock-wait", type=float, help="seconds to wait for the benchmark lock (exit 75 after)")
    parser.add_argument("--no-lock", action="store_true", help="do not take the benchmark lock")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse(raw)
    if not args.no_lock:
        run_locked("bench.scale", raw, args.lock_wait)
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - {"promotion", "memory", "shards"}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}")
    quick = args.quick
    cycles = args.cycles or (100 if quick else 300)
    started, load_start = time.monotonic(), load()
    print(f"bench.scale: {SMOKE} unless run alone on a quiet machine. {os.cpu_count()} CPUs; "
          f"load average before: {load_start}", flush=True)
    out: list[str] = []
    with server() as (srv, described):
        print(f"server: {described}", flush=True)
        if "promotion" in sections:
            print("1. promotion latency", flush=True)
            res = promotion(srv, parked=args.parked, small=args.small, cycles=cycles, warmup=max(5, cycles // 10),
                            spread_keys=args.spread_keys, deep_share=0.1, explain_plans=not args.no_explain)
            out += [f"### Promotion latency, {args.parked:,} parked vs {args.small:,} ({SMOKE}; load "
                    f"{res.load[0]} → {res.load[1]})", "", *promotion_table(res), ""]
            if res.plans:
                out += ["Index used at the large ledger (EXPLAIN ANALYZE, BUFFERS):"]
                heads = [i for i, line in enumerate(res.plans) if line.startswith("-- ")] + [len(res.plans)]
                for a, b in itertools.pairwise(heads):
                    out.append(f"  {res.plans[a][3:]}: {uses_index(res.plans[a + 1:b])}")
                out += ["", "EXPLAIN (ANALYZE, BUFFERS) at the large ledger:", "```", *res.plans, "```", ""]
        if "memory" in sections:
            print("2. worker memory", flush=True)
            sweep = args.sweep_seconds or (10.0 if quick else 30.0)
            runs, loads = memory(srv, parked=args.memory_parked, pairs=args.memory_pairs or (1 if quick else 2),
                                 sweep_seconds=sweep, spread_keys=max(1, min(1_000, args.memory_parked // 100)),
                                 real_parks=5)
            out += [f"### Worker memory, {args.memory_parked:,} parked vs none ({SMOKE}; load "
                    f"{loads[0]} → {loads[1]})", "", *memory_table(runs, sweep), ""]
        if "shards" in sections:
            print("3. hot gate, 8 shards vs 1", flush=True)
            rows, loads = shards(srv, rounds=args.rounds or (5 if quick else 6),
                                 seconds=args.seconds or (2.0 if quick else 5.0), warmup=1.0 if not quick else 0.5,
                                 clients=4)
            out += [f"### Hot gate, 8 shards vs 1 ({SMOKE}; load {loads[0]} → {loads[1]})", "", *rows, ""]
    print()
    print("\n".join(out))
    print(f"load average before {load_start}, after {load()}; total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
