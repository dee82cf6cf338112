"""The Celery gate with real prefork workers, side by side with plain Celery in one run (DESIGN §8).

    python -m bench.gate [--quick] [--tasks 2000] [--pairs 5] [--keyed-pairs 3] [--control] [--loop-admission]
                         [--without-ledger] [--loop-releases]

Starts its own durable PostgreSQL (fsync on) and a Redis broker (``celery_keyed.testing``) unless
``KEYED_DATABASE_URL`` / ``CELERY_BROKER_URL`` name servers; creates and migrates a database of its own. Every
worker is a real ``celery worker -P prefork`` subprocess of the app defined in this module (``-A bench.gate``),
either plain Celery (variant A) or the same tasks with ``celery_keyed.install(app)`` and a configured gate
(variant B). Each run gets a queue of its own. The observer is independent of Celery and of the ledger: every
task RPUSHes its own start and end times (``time.time()``, taken in the pool process) to a Redis list; the
result backend is disabled.

a. Unkeyed tasks, worker with celery-keyed installed (B) vs without (A): interleaved pairs, each pair = a c=2
   worker of A then one of B, each draining N trivial tasks published to its queue before it starts.
   Throughput = N / (last end - first start). Median ratio B/A and its spread (target ≥ 0.97). ``--control``
   also runs the same pairs as A then A again: the ratio's noise floor on this machine.
b. Keyed tasks on 1,000 distinct uncontended keys (``concurrency_key="k:{i}"``) vs the same task as plain
   Celery on the same broker, the same way (target ≥ 0.8). The keys' ledger rows are created before (warm keys).
   ``--loop-admission`` also runs b with admission on the consumer loop (``keyed_admission_batch = 0``, the path
   before the admission thread): what the thread buys, in the same run. ``--without-ledger`` also runs b with every
   claim and release answered in the worker itself, no database call (``answer_without_ledger``: the bound is NOT
   kept, a measurement only): what the worker's own code costs a keyed task, the most a faster ledger could give;
   then again with those answers given on the consumer loop itself, no thread between (``keyed-free-loop``:
   admission at a pool process's start, releases in the outcome hook): what the hand-overs to the worker's threads
   cost on top. ``--loop-releases`` also runs b with the uncontended releases made from the consumer loop without
   blocking it, instead of by the releaser's thread (b-loop), and with the claims taken ahead made the same way too
   (b-loop2) (``bench/loop_releases.py``: a measurement of that design for gate b only, not a feature), taking turns
   with plain Celery and with b in the same rounds.
c. Handoff on one contended key, K = 1: two c=2 workers already running, a burst of small tasks (5 ms) of one
   key. Handoff = start of a task - end of the task before it on that key (the end is taken just before the task
   returns; the slot is released after that, in the worker's main process). p50 / p99 (target ≤ 5 / ≤ 25 ms),
   also over only the handoffs after the ledger had recorded every arrival (nothing left to park), and broker
   messages published per completed task (Redis ``INFO commandstats`` LPUSH calls, the initial
   publish included; target ≤ 2, ≤ 1 with local handoff).
d. The contended workload of DESIGN §8: 5 keys x 40 tasks of 50 ms, K = 1, two c=4 workers (8 pool slots)
   already running; ideal makespan 2.0 s. Makespan = last end - first start (target ≤ 1.10 x ideal).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

ENV_VARIANT = "BENCH_GATE_VARIANT"  # "plain" (A) or "keyed" (B), for the worker processes
ENV_OBSERVER = "BENCH_GATE_OBSERVER"  # Redis URL of the observer lists
READY_LIST = "bench:gate:ready"  # worker hostnames, pushed by worker_ready
WORKER_APP = "bench.gate"  # the module workers load (-A); a probe may wrap it

KEYS = 1000  # distinct keys of scenario b
#: Arrivals the ledger has recorded, by primary key (the task ids the run published): an index probe per id. A
#: scan by ``key`` (no index) every 10 ms cost ~3 ms each, ~14 % of a core during the burst it was timing.
ARRIVED_SQL = "SELECT count(*) FROM keyed_tasks WHERE task_id = ANY(CAST(:ids AS text[]))"
LEDGER_POLL = 0.05  # seconds between two looks at the ledger while it has not recorded every arrival
#: A configured name no benchmark task uses: the gate is configured, as it would be in production.
LIMITS = {"bench_gate": {"limit": 10, "shards": 2}}


# -- the app the workers run ------------------------------------------------------------------------------------

_observers: dict[int, Any] = {}


def _observer(url: str) -> Any:
    """One Redis client per process (pool processes are forked: never share the parent's socket)."""
    client = _observers.get(os.getpid())
    if client is None:
        import redis

        client = _observers[os.getpid()] = redis.Redis.from_url(url)
    return client


def make_app(variant: str, broker_url: str, database_url: str, observer_url: str) -> Any:
    """The benchmark's Celery app: plain (A), or the same tasks with the gate installed and configured (B).

    Tasks are named explicitly so that the producer (``python -m bench.gate``, i.e. ``__main__``) and the
    workers (``-A bench.gate``) agree."""
    from celery import Celery

    app = Celery("bench_gate", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=None,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    keyed = variant in ("keyed", "keyed-loop", "keyed-free", "keyed-free-loop", "keyed-loop-releases",
                     "keyed-loop-ledger")
    if keyed:
        import celery_keyed

        app.conf.update(keyed_database_url=database_url, keyed_concurrency_limits=LIMITS)
        if variant in ("keyed-loop", "keyed-free-loop"):  # admission on the consumer loop, one at a time
            app.conf.update(keyed_admission_batch=0)
        celery_keyed.install(app)

    def task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
        """A keyed task in B, the same function as a plain task in A."""
        if keyed and "concurrency_key" in options:
            from celery_keyed import keyed_task

            return keyed_task(app=app, bind=True, **options)
        options.pop("concurrency_key", None)
        return app.task(bind=True, **options)

    @task(name="bench.noop")
    def noop(self: Any, run: str) -> None:
        started = time.time()
        _observer(observer_url).rpush(run, f"{started} {time.time()}")

    @task(name="bench.keyed_noop", concurrency_key="k:{i}")
    def keyed_noop(self: Any, run: str, i: int) -> None:
        started = time.time()
        _observer(observer_url).rpush(run, f"{started} {time.time()}")

    @task(name="bench.hold", concurrency_key="{key}")
    def hold(self: Any, run: str, key: str, seconds: float) -> None:
        started = time.time()
        time.sleep(seconds)
        nonce = "nonce" if getattr(self.request, "keyed_nonce", None) else "-"
        ended = time.time()
        _observer(observer_url).rpush(
            run, f"{started} {ended} {key} {self.request.hostname} {os.getpid()} {nonce} {self.request.id}"
        )

    app.bench_tasks = {"noop": noop, "keyed_noop": keyed_noop, "hold": hold}
    return app


def answer_without_ledger(*, on_loop: bool = False) -> None:
    """A worker of variant "keyed-free" (``--without-ledger``): its claims and releases are answered here, admitted
    and released, without a database call (the heartbeat and the sweeper still run theirs, a few per second). No bound
    is kept: it measures what the worker's own code costs a keyed task, the floor a faster ledger could reach.
    ``on_loop`` (variant "keyed-free-loop"): the releaser's thread is not started either, so a release is answered in
    the outcome hook that hands it over (as a stopped releaser does), and the app admits on the loop
    (``keyed_admission_batch = 0``): the same answers with no thread between the loop and them."""
    from celery_keyed.ledger import Admission, Ledger, ReleaseReport, Verdict

    def admitted(*args: Any, **kwargs: Any) -> Admission:
        return Admission(Verdict.ADMITTED, fence=1, shard=0)

    ledger: Any = Ledger
    ledger.admit = admitted
    ledger.admit_many = lambda self, arrivals, now=None: [admitted() for _ in arrivals]
    ledger.park_at_receipt = lambda self, arrival, now=None: None  # left to its admission
    ledger.release = lambda self, *args, **kwargs: ReleaseReport(released=True)
    ledger.release_many = lambda self, requests, now=None: [ReleaseReport(released=True) for _ in requests]
    ledger.confirm = lambda self, *args, **kwargs: True
    if on_loop:
        from celery_keyed.worker.releaser import Releaser

        releaser: Any = Releaser
        releaser.start = lambda self: None


if os.environ.get(ENV_VARIANT) and __name__ != "__main__":  # a worker: celery -A bench.gate worker
    from celery import signals

    if os.environ[ENV_VARIANT] in ("keyed-loop-releases", "keyed-loop-ledger"):
        from bench.loop_releases import install, install_claims

        install()
        if os.environ[ENV_VARIANT] == "keyed-loop-ledger":
            install_claims()
    if os.environ[ENV_VARIANT] in ("keyed-free", "keyed-free-loop"):
        answer_without_ledger(on_loop=os.environ[ENV_VARIANT] == "keyed-free-loop")

    app = make_app(
        os.environ[ENV_VARIANT],
        os.environ["CELERY_BROKER_URL"],
        os.environ.get("KEYED_DATABASE_URL", ""),
        os.environ[ENV_OBSERVER],
    )

    @signals.worker_process_init.connect(weak=False)
    def _connect_observer(**kwargs: Any) -> None:
        """Each pool process opens its observer connection when it starts: a task body's first record would
        otherwise connect after the body's end was stamped, and that connect would count in the handoff that
        follows it (the first handoff of every fresh pool process)."""
        _observer(os.environ[ENV_OBSERVER]).ping()

    @signals.worker_ready.connect(weak=False)
    def _announce_ready(sender: Any = None, **kwargs: Any) -> None:
        _observer(os.environ[ENV_OBSERVER]).rpush(READY_LIST, str(getattr(sender, "hostname", "?")))


# -- the harness --------------------------------------------------------------------------------------------------


@dataclass
class Bench:
    broker_url: str
    database_url: str
    redis: Any  # observer / stats client (the broker's server)
    logs: Path
    producers: dict[str, Any] = field(default_factory=dict)
    seq: int = 0
    _ledger: Any = None

    @property
    def ledger(self) -> Any:
        """An engine on the ledger's database, for watching it (one connection)."""
        if self._ledger is None:
            import sqlalchemy as sa

            self._ledger = sa.create_engine(self.database_url, pool_size=1, max_overflow=0)
        return self._ledger

    def tag(self, what: str) -> str:
        self.seq += 1
        return f"{what}-{self.seq}-{uuid.uuid4().hex[:6]}"

    def producer(self, variant: str) -> Any:
        if variant not in self.producers:
            self.producers[variant] = make_app(variant, self.broker_url, self.database_url, self.broker_url)
        return self.producers[variant]

    def publish(self, variant: str, task: str, queue: str, calls: list[tuple[Any, ...]]) -> list[str]:
        """Publish the calls; return their task ids."""
        app = self.producer(variant)
        sig = app.bench_tasks[task]
        with app.producer_or_acquire() as producer:
            return [sig.apply_async(args, queue=queue, producer=producer).id for args in calls]

    def lpush_calls(self) -> int:
        stats = self.redis.info("commandstats")
        return int(stats.get("cmdstat_lpush", {}).get("calls", 0))

    def observed(self, run: str) -> list[list[str]]:
        return [entry.decode().split() for entry in self.redis.lrange(run, 0, -1)]

    @contextlib.contextmanager
    def workers(self, variant: str, queue: str, names: list[str], concurrency: int,
                wait_ready: bool) -> Iterator[list[Worker]]:
        started = [Worker.start(self, variant, queue, name, concurrency) for name in names]
        try:
            if wait_ready:
                deadline = time.monotonic() + 90
                want = {w.hostname for w in started}
                while not want <= {h.decode() for h in self.redis.lrange(READY_LIST, 0, -1)}:
                    for w in started:
                        w.check()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"workers not ready:\n{started[0].tail()}")
                    time.sleep(0.05)
            yield started
        finally:
            for w in started:
                w.stop()

    def wait_for(self, run: str, n: int, workers: list[Worker], timeout: float, ids: list[str] | None = None,
                 progress: Callable[[int], None] | None = None) -> float:
        """Wait until ``n`` tasks of ``run`` were observed. With ``ids``, also watch the ledger (every
        ``LEDGER_POLL`` s, by primary key): the wall time at which it had recorded (admitted or parked) every one
        of those task ids, else +inf."""
        recorded = float("inf") if ids else 0.0
        deadline = time.monotonic() + timeout
        next_look = 0.0
        while (count := self.redis.llen(run)) < n:
            if progress is not None:
                progress(count)
            for w in workers:
                w.check()
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {w.hostname}\n{w.tail()}" for w in workers)
                raise RuntimeError(f"{run}: {count} of {n} tasks observed after {timeout:.0f} s\n{tails}")
            if ids and recorded == float("inf") and time.monotonic() >= next_look:
                import sqlalchemy as sa

                next_look = time.monotonic() + LEDGER_POLL
                with self.ledger.connect() as conn:
                    arrived = conn.execute(sa.text(ARRIVED_SQL), {"ids": ids}).scalar_one()
                if arrived >= len(ids):
                    recorded = time.time()
            time.sleep(0.01 if ids else 0.02)
        return recorded


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    hostname: str
    log: Path

    @classmethod
    def start(cls, bench: Bench, variant: str, queue: str, name: str, concurrency: int) -> Worker:
        hostname = f"{name}@bench"
        log = bench.logs / f"{name}.log"
        env = dict(os.environ)
        env.update({
            ENV_VARIANT: variant,
            ENV_OBSERVER: bench.broker_url,
            "CELERY_BROKER_URL": bench.broker_url,
            "KEYED_DATABASE_URL": bench.database_url,
            "PYTHONPATH": str(ROOT),
            "PYTHONWARNINGS": "ignore",
        })
        cmd = [sys.executable, "-m", "celery", "-A", WORKER_APP, "worker", "-P", "prefork", "-c", str(concurrency),
               "-n", hostname, "-Q", queue, "--without-gossip", "--without-mingle", "--without-heartbeat",
               "-l", "WARNING"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return cls(proc, hostname, log)

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.hostname} exited ({self.proc.returncode}):\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


# -- scenarios ----------------------------------------------------------------------------------------------------


@dataclass
class CpuWindow:
    """Milliseconds of CPU per task, by process, spent while a drain went from 10 % to 90 % of its tasks observed
    (``/proc`` through psutil): the worker's main process (the consumer loop and the gate's threads), its pool
    processes, the PostgreSQL server (every backend and helper process) and the Redis server. The window leaves out
    the worker's start and its last tasks."""
    n: int
    worker_pid: int
    server_pids: tuple[int, int]  # (PostgreSQL's postmaster, Redis)
    start: tuple[int, dict[str, float]] | None = None
    end: tuple[int, dict[str, float]] | None = None

    def progress(self, count: int) -> None:
        if self.start is None and count >= self.n // 10:
            self.start = (count, self._snapshot())
        elif self.start is not None and self.end is None and count >= self.n * 9 // 10:
            self.end = (count, self._snapshot())

    def per_task(self) -> dict[str, float] | None:
        """{"main", "pool", "postgres", "redis", "total"}: ms of CPU per task in the window, or None (not seen)."""
        if self.start is None or self.end is None or self.end[0] <= self.start[0]:
            return None
        tasks = self.end[0] - self.start[0]
        split = {k: (self.end[1][k] - self.start[1][k]) / tasks * 1000 for k in self.start[1]}
        split["total"] = sum(split.values())
        return split

    def _snapshot(self) -> dict[str, float]:
        import psutil

        def seconds(proc: Any) -> float:
            try:
                t = proc.cpu_times()
                return float(t.user + t.system)
            except psutil.Error:
                return 0.0

        def tree(pid: int) -> tuple[float, float]:  # (the process, its live children)
            try:
                proc = psutil.Process(pid)
                kids = proc.children(recursive=True)
            except psutil.Error:
                return 0.0, 0.0
            return seconds(proc), sum(seconds(k) for k in kids)

        main, pool = tree(self.worker_pid)
        postmaster, backends = tree(self.server_pids[0])
        redis_own, redis_kids = tree(self.server_pids[1])
        return {"main": main, "pool": pool, "postgres": postmaster + backends, "redis": redis_own + redis_kids}


def server_pids(bench: Bench) -> tuple[int, int]:
    """(PostgreSQL's postmaster, the Redis server): the processes whose CPU a drain's window counts."""
    import psutil
    import sqlalchemy as sa

    with bench.ledger.connect() as conn:
        backend = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    postmaster = psutil.Process(int(backend)).ppid()
    return postmaster, int(bench.redis.info("server")["process_id"])


def throughput(bench: Bench, variant: str, task: str, n: int, *, keyed_args: bool
               ) -> tuple[float, float, dict[str, float] | None]:
    """One worker (c=2) drains ``n`` tasks published before it starts: (tasks/s, broker messages per task, ms of CPU
    per task by process: ``CpuWindow.per_task``)."""
    run, queue = bench.tag(f"obs-{task}-{variant}"), bench.tag(f"q-{task}-{variant}")
    calls = [(run, i % KEYS) if keyed_args else (run,) for i in range(n)]
    pids = server_pids(bench)
    before = bench.lpush_calls()
    bench.publish(variant, task, queue, calls)
    with bench.workers(variant, queue, [bench.tag(variant)], 2, wait_ready=False) as ws:
        window = CpuWindow(n, ws[0].proc.pid, pids)
        bench.wait_for(run, n, ws, timeout=max(120.0, n / 20), progress=window.progress)
        published = bench.lpush_calls() - before
    if variant in ("keyed-loop-releases", "keyed-loop-ledger"):  # what the loop did (bench/loop_releases.py)
        for worker in ws:
            for line in worker.log.read_text(errors="replace").splitlines():
                if "loop-releases:" in line:
                    print(f"    {line.split('loop-releases:', 1)[1].strip()}", flush=True)
    rows = bench.observed(run)
    bench.redis.delete(run)
    first = min(float(r[0]) for r in rows)
    last = max(float(r[1]) for r in rows)
    return n / (last - first), published / n, window.per_task()


@dataclass
class Contended:
    tasks: int
    makespan: float
    recorded_after: float  # seconds from the first start until the ledger had recorded every arrival
    handoffs: list[float]  # seconds, end of a task → start of the next one of its key
    steady: list[float]  # the handoffs after the ledger had recorded every arrival (nothing left to park)
    overlaps: int  # starts before the end of the previous task of the key (a bound violation for K = 1)
    per_task: float  # broker messages published per completed task
    kinds: Counter[str]  # how the next task of a key got its slot
    per_key: dict[str, float]  # key → sum of the measured task durations (the key's critical path)
    gaps: list[tuple[float, str]] = field(default_factory=list)  # the largest handoffs, with their kind


def contended(bench: Bench, keys: list[str], per_key: int, seconds: float, workers: int,
              concurrency: int) -> Contended:
    """Workers of variant B already running; a burst of ``per_key`` tasks of each key (round-robin order)."""
    run, queue = bench.tag("obs-hold"), bench.tag("q-hold")
    calls = [(run, key, seconds) for _ in range(per_key) for key in keys]
    names = [bench.tag("keyed") for _ in range(workers)]
    with bench.workers("keyed", queue, names, concurrency, wait_ready=True) as ws:
        before = bench.lpush_calls()
        ids = bench.publish("keyed", "hold", queue, calls)
        recorded = bench.wait_for(run, len(calls), ws, timeout=120.0 + len(calls) * seconds * 4, ids=ids)
        published = bench.lpush_calls() - before
    rows = bench.observed(run)
    bench.redis.delete(run)
    by_key: dict[str, list[tuple[float, float, str, str, str]]] = defaultdict(list)
    for start, end, key, host, pid, nonce, _task_id in rows:
        by_key[key].append((float(start), float(end), host, pid, nonce))
    first = min(float(r[0]) for r in rows)
    handoffs: list[float] = []
    steady: list[float] = []
    gaps: list[tuple[float, str]] = []
    kinds: Counter[str] = Counter()
    overlaps = 0
    for intervals in by_key.values():
        intervals.sort()
        for prev, nxt in itertools.pairwise(intervals):
            gap = nxt[0] - prev[1]
            if gap < 0:
                overlaps += 1
                continue
            where = "same process" if (nxt[2], nxt[3]) == (prev[2], prev[3]) else (
                "same worker" if nxt[2] == prev[2] else "other worker")
            kind = f"{'promoted (nonce)' if nxt[4] == 'nonce' else 'admitted (no nonce)'}, {where}"
            kinds[kind] += 1
            handoffs.append(gap)
            if prev[1] >= recorded:
                steady.append(gap)
            gaps.append((gap, kind))
    gaps.sort(reverse=True)
    return Contended(
        tasks=len(rows),
        makespan=max(float(r[1]) for r in rows) - first,
        recorded_after=recorded - first,
        handoffs=handoffs,
        steady=steady,
        overlaps=overlaps,
        per_task=published / len(calls),
        kinds=kinds,
        per_key={k: sum(e - s for s, e, *_ in v) for k, v in by_key.items()},
        gaps=gaps[:5],
    )


def warm_keys(database_url: str) -> None:
    """Create the ledger rows of scenario b's keys (a claim and a release each), as a running system has them."""
    import sqlalchemy as sa

    from celery_keyed.ledger import Arrival, Ledger, Outcome, Token

    engine = sa.create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        ledger = Ledger(engine)
        prefix = uuid.uuid4().hex[:8]
        for i in range(KEYS):
            task_id = f"warm-{prefix}-{i}"
            admission = ledger.admit(Arrival(task_id=task_id, key=f"k:{i}"))
            ledger.release(Token(task_id, 0), admission.fence or 0, Outcome.COMPLETED)
    finally:
        engine.dispose()


# -- reporting helpers --------------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


@dataclass
class Pairs:
    """What ``ratio_pairs`` measured: B/A throughput ratios, (A, B) tasks/s, B's broker messages per task, and
    (A, B) ms of CPU per task by process (``CpuWindow.per_task``)."""
    ratios: list[float] = field(default_factory=list)
    rates: list[tuple[float, float]] = field(default_factory=list)
    published: list[float] = field(default_factory=list)
    cpu: list[tuple[dict[str, float] | None, dict[str, float] | None]] = field(default_factory=list)


def ratio_pairs(bench: Bench, pairs: int, task: str, n: int, keyed_args: bool, label: str,
                second: str = "keyed") -> Pairs:
    """``pairs`` interleaved pairs: a worker of A (plain) then one of ``second`` (B, or A again for the A/A
    control)."""
    return ratio_rounds(bench, pairs, task, n, keyed_args, [label], [second])[0]


def ratio_rounds(bench: Bench, rounds: int, task: str, n: int, keyed_args: bool, labels: list[str],
                 seconds: list[str]) -> list[Pairs]:
    """``rounds`` rounds of a worker of A (plain) then one of each of ``seconds`` in turn (their order reversed every
    other round): each one's ratio to the A of its own round, one ``Pairs`` per variant."""
    outs = [Pairs() for _ in seconds]
    names = {"keyed": "B keyed", "keyed-loop": "B' keyed, loop admission", "keyed-free": "B0 keyed, no ledger calls",
             "keyed-free-loop": "B00 keyed, no ledger calls, on the loop",
             "keyed-loop-releases": "B keyed, releases from the loop",
             "keyed-loop-ledger": "B keyed, claims ahead and releases from the loop"}
    for p in range(rounds):
        a, _, cpu_a = throughput(bench, "plain", task, n, keyed_args=keyed_args)
        order = list(zip(labels, seconds, outs, strict=True))
        for label, second, out in order if p % 2 == 0 else order[::-1]:
            b, per_task, cpu_b = throughput(bench, second, task, n, keyed_args=keyed_args)
            out.rates.append((a, b))
            out.ratios.append(b / a)
            out.published.append(per_task)
            out.cpu.append((cpu_a, cpu_b))
            name = names.get(second, "A again")
            cpu = "".join(f", CPU {cpu['total']:.2f} ms/task" if cpu else "" for cpu in (cpu_a, cpu_b))
            print(f"  {label} pair {p + 1}: A plain {a:6.0f} tasks/s, {name} {b:6.0f} tasks/s, ratio {b / a:.3f}{cpu}",
                  flush=True)
    return outs


# -- main ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def servers() -> Iterator[tuple[str, str, str]]:
    """(ledger URL of a fresh migrated database, broker URL, description)."""
    import psycopg
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    from celery_keyed.ledger import migrate
    from celery_keyed.testing import start_postgres, start_redis

    with start_postgres(durable=True) as pg, start_redis() as rd:
        admin_url = make_url(pg.url).set(drivername="postgresql").render_as_string(hide_password=False)
        name = f"keyed_bench_gate_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
            row = admin.execute("SHOW server_version").fetchone()
            fsync = admin.execute("SHOW fsync").fetchone()
        url = pg.url_for(name)
        try:
            engine = sa.create_engine(url)
            try:
                migrate(engine)
            finally:
                engine.dispose()
            described = (f"PostgreSQL {row[0] if row else '?'} (fsync={fsync[0] if fsync else '?'}, "
                         f"{'started by the benchmark' if pg.managed else 'KEYED_DATABASE_URL'}), Redis "
                         f"{'started by the benchmark' if rd.managed else 'CELERY_BROKER_URL'}")
            yield url, rd.url, described
        finally:
            with psycopg.connect(admin_url, autocommit=True) as admin:
                admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run: fewer pairs, fewer tasks")
    parser.add_argument("--tasks", type=int, help="tasks per throughput run (a, b); default 2000, quick 500")
    parser.add_argument("--pairs", type=int, help="interleaved pairs of a (default 5, quick 2)")
    parser.add_argument("--keyed-pairs", type=int, help="interleaved pairs of b (default 3, quick 1)")
    parser.add_argument("--handoff-tasks", type=int, help="tasks of c per run (default 200, quick 100)")
    parser.add_argument("--repeats", type=int, help="runs of c and of d (default 2 and 3, quick 1)")
    parser.add_argument("--without-ledger", action="store_true",
                        help="also b with claims and releases answered in the worker, no database (no bound kept), "
                             "through its threads (b0) and on its loop (b00)")
    parser.add_argument("--loop-releases", action="store_true",
                        help="also b with the uncontended releases made from the consumer loop without blocking it "
                             "(a measurement of that design, taking turns with b)")
    parser.add_argument("--loop-admission", action="store_true",
                        help="also run b's pairs with admission on the consumer loop (keyed_admission_batch = 0)")
    parser.add_argument("--only", default="abcd", metavar="SCENARIOS",
                        help="run only these scenarios, e.g. b or cd (default abcd: all, with the full report)")
    parser.add_argument("--control", action="store_true",
                        help="also run a's pairs as A then A again: the noise floor of a ratio on this machine")
    args = parser.parse_args(argv)
    only = set(args.only)
    if not only or only - set("abcd"):
        parser.error("--only takes letters of abcd")
    quick = args.quick
    n = args.tasks or (500 if quick else 2000)
    pairs = args.pairs or (2 if quick else 5)
    keyed_pairs = args.keyed_pairs or (1 if quick else 3)
    handoff_tasks = args.handoff_tasks or (100 if quick else 200)
    c_runs = args.repeats or (1 if quick else 2)
    d_runs = args.repeats or (1 if quick else 3)

    import redis

    started = time.monotonic()
    with servers() as (database_url, broker_url, described), tempfile.TemporaryDirectory(
        prefix="bench-gate-"
    ) as logs:
        client = redis.Redis.from_url(broker_url)
        bench = Bench(broker_url, database_url, client, Path(logs))
        load = os.getloadavg()
        print(f"servers: {described}; {os.cpu_count()} CPUs, load average {load[0]:.1f} at start", flush=True)

        a_pairs, b_pairs = Pairs(), Pairs()
        c_results: list[Contended] = []
        d_results: list[Contended] = []
        control: list[float] = []
        loop_ratios: list[float] = []
        free_pairs = loop_free_pairs = loop_release_pairs = loop_ledger_pairs = Pairs()
        if "a" in only:
            print(f"\na. unkeyed tasks, A plain vs B celery-keyed installed: {pairs} pairs of {n} tasks, c=2",
                  flush=True)
            a_pairs = ratio_pairs(bench, pairs, "noop", n, False, "a")
        if "a" in only and args.control:
            print(f"\na'. control: A plain then A plain again, {pairs} pairs of {n} tasks, c=2", flush=True)
            control = ratio_pairs(bench, pairs, "noop", n, False, "a'", second="plain").ratios

        if "b" in only:
            print(f"\nb. keyed tasks on {KEYS} uncontended keys vs the same task plain: {keyed_pairs} pairs of {n} "
                  f"tasks, c=2 (warming {KEYS} keys first)", flush=True)
            warm_keys(database_url)
            if args.loop_releases:
                b_pairs, loop_release_pairs, loop_ledger_pairs = ratio_rounds(
                    bench, keyed_pairs, "keyed_noop", n, True, ["b", "b-loop", "b-loop2"],
                    ["keyed", "keyed-loop-releases", "keyed-loop-ledger"],
                )
            else:
                b_pairs = ratio_pairs(bench, keyed_pairs, "keyed_noop", n, True, "b")
        if "b" in only and args.loop_admission:
            print(f"\nb'. the same, admission on the consumer loop (keyed_admission_batch = 0): {keyed_pairs} pairs",
                  flush=True)
            loop_ratios = ratio_pairs(bench, keyed_pairs, "keyed_noop", n, True, "b'", second="keyed-loop").ratios
        if "b" in only and args.without_ledger:
            print(f"\nb0. the same, claims and releases answered in the worker without the ledger (no bound kept),"
                  f" and b00, those answers given on the consumer loop (no thread between): {keyed_pairs} rounds",
                  flush=True)
            free_pairs, loop_free_pairs = ratio_rounds(
                bench, keyed_pairs, "keyed_noop", n, True, ["b0", "b00"], ["keyed-free", "keyed-free-loop"]
            )

        if "c" in only:
            print(f"\nc. handoff, one key, K = 1: {c_runs} run(s) of {handoff_tasks} tasks of 5 ms, 2 workers c=2",
                  flush=True)
        for r in range(c_runs if "c" in only else 0):
            res = contended(bench, [f"h{r}:{uuid.uuid4().hex[:6]}"], handoff_tasks, 0.005, 2, 2)
            c_results.append(res)
            print(f"  run {r + 1}: p50 {pct(res.handoffs, 0.5) * 1000:.2f} ms, p99 "
                  f"{pct(res.handoffs, 0.99) * 1000:.2f} ms, max {max(res.handoffs) * 1000:.1f} ms; after the "
                  f"ledger had every arrival (+{res.recorded_after:.2f} s): p50 {pct(res.steady, 0.5) * 1000:.2f} "
                  f"ms, p99 {pct(res.steady, 0.99) * 1000:.2f} ms ({len(res.steady)}); "
                  f"{res.per_task:.3f} messages/task, overlaps {res.overlaps}", flush=True)

        if "d" in only:
            print(f"\nd. contended workload: {d_runs} run(s) of 5 keys x 40 tasks of 50 ms, K = 1, 2 workers c=4",
                  flush=True)
        for r in range(d_runs if "d" in only else 0):
            tag = uuid.uuid4().hex[:6]
            res = contended(bench, [f"m{i}:{tag}" for i in range(5)], 40, 0.05, 2, 4)
            d_results.append(res)
            print(f"  run {r + 1}: makespan {res.makespan:.3f} s = {res.makespan / 2.0:.3f} x ideal; handoff p50 "
                  f"{pct(res.handoffs, 0.5) * 1000:.2f} ms, p99 {pct(res.handoffs, 0.99) * 1000:.2f} ms; "
                  f"{res.per_task:.3f} messages/task; overlaps {res.overlaps}; ledger had every arrival at "
                  f"+{res.recorded_after:.2f} s", flush=True)
        load_end = os.getloadavg()
        if bench._ledger is not None:
            bench._ledger.dispose()
        client.delete(READY_LIST)
        for app in bench.producers.values():
            app.close()

    print()
    if only == set("abcd"):
        print(report(a_pairs, b_pairs, c_results, d_results, control))
    else:
        print(partial_report(a_pairs, b_pairs, c_results, d_results))
    if loop_ratios:
        print(f"b'. keyed with admission on the loop / plain: median {statistics.median(loop_ratios):.3f} "
              f"(admission thread: {statistics.median(b_pairs.ratios):.3f})")
    if free_pairs.ratios:
        print(f"b0. keyed without ledger calls / plain: median {statistics.median(free_pairs.ratios):.3f}, range "
              f"{min(free_pairs.ratios):.3f}-{max(free_pairs.ratios):.3f} (with the ledger: "
              f"{statistics.median(b_pairs.ratios):.3f})")
        print("\n".join(row.replace("| b. ", "| b0. ") for row in cpu_rows(free_pairs)))
    for label, what, pairs_of, base_label, base in (
        ("b-loop", "keyed, releases from the loop", loop_release_pairs, "b", b_pairs),
        ("b-loop2", "keyed, claims ahead and releases from the loop", loop_ledger_pairs, "b", b_pairs),
        ("b00", "keyed without ledger calls, on the loop", loop_free_pairs, "b0", free_pairs),
    ):
        if pairs_of.ratios:
            print(variant_report(label, what, pairs_of, base_label, base))
    print(f"\nload average {load[0]:.1f} at start, {load_end[0]:.1f} at end; total {time.monotonic() - started:.0f} s")
    return 0


def variant_report(label: str, what: str, pairs: Pairs, base_label: str, base: Pairs) -> str:
    """A variant measured in the same rounds as ``base``: its ratio to plain Celery, to ``base`` round by round, and its
    CPU per task."""
    against = statistics.median(x / y for x, y in zip(pairs.ratios, base.ratios, strict=True))
    lines = [f"{label}. {what} / plain: median {statistics.median(pairs.ratios):.3f}, range {min(pairs.ratios):.3f}-"
             f"{max(pairs.ratios):.3f}; against {base_label} in the same rounds: median {against:.3f}"]
    lines.extend(row.replace("| b. ", f"| {label}. ") for row in cpu_rows(pairs))
    return "\n".join(lines)


def partial_report(a_pairs: Pairs, b_pairs: Pairs, c_results: list[Contended], d_results: list[Contended]) -> str:
    """The medians of the scenarios an ``--only`` run ran (the full report needs all four)."""
    lines = []
    for label, pairs in (("a", a_pairs), ("b", b_pairs)):
        if pairs.ratios:
            lines.append(f"{label}. B/A median {statistics.median(pairs.ratios):.3f}, range "
                         f"{min(pairs.ratios):.3f}-{max(pairs.ratios):.3f}")
    if b_pairs.ratios:
        lines.extend(cpu_rows(b_pairs))
    handoffs = [h for r in c_results for h in r.handoffs]
    if handoffs:
        lines.append(f"c. handoff p50 {pct(handoffs, 0.5) * 1000:.2f} ms, p99 {pct(handoffs, 0.99) * 1000:.2f} ms")
    if d_results:
        lines.append(f"d. makespan / ideal median {statistics.median(r.makespan / 2.0 for r in d_results):.3f}")
    return "\n".join(lines)


def cpu_medians(splits: list[dict[str, float] | None]) -> dict[str, float] | None:
    """The median of each part of ``CpuWindow.per_task`` over the runs that measured one."""
    seen = [s for s in splits if s]
    return {k: statistics.median(s[k] for s in seen) for k in seen[0]} if seen else None


def cpu_rows(b_pairs: Pairs) -> list[str]:
    """b's CPU per task by process (medians of the pairs): plain Celery's, celery-keyed's, and the ratio."""
    plain, keyed = cpu_medians([a for a, _ in b_pairs.cpu]), cpu_medians([b for _, b in b_pairs.cpu])
    if plain is None or keyed is None:
        return []

    def parts(split: dict[str, float]) -> str:
        return (f"main {split['main']:.2f}, pool {split['pool']:.2f}, PostgreSQL {split['postgres']:.2f}, "
                f"Redis {split['redis']:.2f}; **{split['total']:.2f}**")

    ratio = keyed["total"] / plain["total"] if plain["total"] > 0 else float("nan")
    return [
        f"| b. ms of CPU per task, plain Celery (10-90 % of each drain) | {parts(plain)} | | |",
        f"| b. ms of CPU per task, keyed | {parts(keyed)}; **{ratio:.2f} x** plain's | ≤ 1.73 x (1.8 ms where "
        f"plain took 1.04) | {verdict(ratio <= 1.73)} |",
    ]


def report(a_pairs: Pairs, b_pairs: Pairs, c_results: list[Contended], d_results: list[Contended],
           control: list[float]) -> str:
    a_ratios, a_rates, b_ratios, b_rates = a_pairs.ratios, a_pairs.rates, b_pairs.ratios, b_pairs.rates
    b_published = b_pairs.published
    a_med, b_med = statistics.median(a_ratios), statistics.median(b_ratios)
    handoffs = [h for r in c_results for h in r.handoffs]
    c50, c99 = pct(handoffs, 0.5) * 1000, pct(handoffs, 0.99) * 1000
    steady = [h for r in c_results for h in r.steady] or [float("nan")]
    s50, s99 = pct(steady, 0.5) * 1000, pct(steady, 0.99) * 1000
    c_msgs = statistics.mean(r.per_task for r in c_results)
    d_ratios = [r.makespan / 2.0 for r in d_results]
    d_med = statistics.median(d_ratios)
    d_handoffs = [h for r in d_results for h in r.handoffs]
    d_msgs = statistics.mean(r.per_task for r in d_results)

    def rates(pairs: list[tuple[float, float]]) -> str:
        return (f"A {statistics.median(a for a, _ in pairs):.0f} / B {statistics.median(b for _, b in pairs):.0f} "
                "tasks/s (medians)")

    # A spread of the pairs wider than the 3 % being tested means the machine cannot resolve it.
    noisy = (f" (inconclusive: pairs spread {max(a_ratios) - min(a_ratios):.2f})"
             if max(a_ratios) - min(a_ratios) > 0.06 else "")
    rows = [
        "| measure | result | target | |",
        "|---|---|---|---|",
        f"| a. unkeyed, installed vs not (B/A), {len(a_ratios)} pairs | median **{a_med:.3f}**, range "
        f"{min(a_ratios):.3f}-{max(a_ratios):.3f}; {rates(a_rates)} | ≥ 0.97 | {verdict(a_med >= 0.97)}"
        f"{noisy} |",
        f"| b. keyed, 1,000 uncontended keys vs plain (B/A), {len(b_ratios)} pairs | median **{b_med:.3f}**, range "
        f"{min(b_ratios):.3f}-{max(b_ratios):.3f}; {rates(b_rates)} | ≥ 0.8 | {verdict(b_med >= 0.8)} |",
        *cpu_rows(b_pairs),
        f"| c. handoff, one key, K = 1 ({len(handoffs)} handoffs) | p50 **{c50:.2f} ms**, p99 **{c99:.2f} ms** "
        f"(max {max(handoffs) * 1000:.1f} ms) | p50 ≤ 5, p99 ≤ 25 ms | {verdict(c50 <= 5 and c99 <= 25)} |",
        f"| c. the same, only once the ledger had every arrival ({len(steady)} handoffs, nothing left to park) "
        f"| p50 **{s50:.2f} ms**, p99 **{s99:.2f} ms** | p50 ≤ 5, p99 ≤ 25 ms | {verdict(s50 <= 5 and s99 <= 25)} |",
        f"| c. broker messages published per task (one key) | **{c_msgs:.3f}** | ≤ 2 (≤ 1 with local handoff) "
        f"| ≤ 2 {verdict(c_msgs <= 2)}, ≤ 1 {verdict(c_msgs <= 1.0 + 1e-9)} |",
        f"| d. makespan / ideal (2.0 s), 5 keys x 40 x 50 ms, {len(d_ratios)} runs | median **{d_med:.3f}**, runs "
        f"{', '.join(f'{x:.3f}' for x in d_ratios)} | ≤ 1.10 (aim 1.05) | {verdict(d_med <= 1.10)} |",
        f"| d. handoff / messages per task | p50 {pct(d_handoffs, 0.5) * 1000:.2f} ms, p99 "
        f"{pct(d_handoffs, 0.99) * 1000:.2f} ms; {d_msgs:.3f} messages/task | | |",
    ]
    if control:
        c_med = statistics.median(control)
        rows.append(f"| a'. control: A then A again, {len(control)} pairs | median **{c_med:.3f}**, "
                    f"range {min(control):.3f}-{max(control):.3f} | 1.00 | noise floor |")
    lines = ["\n".join(rows), ""]
    lines.append(f"b. broker messages published per keyed task (B): {statistics.mean(b_published):.2f}")
    for r in c_results:
        lines.append(f"c. run: the ledger had all {r.tasks} arrivals at "
                     f"+{r.recorded_after:.2f} s after the first start (makespan {r.makespan:.2f} s)")
    for label, results in (("c", c_results), ("d", d_results)):
        kinds: Counter[str] = Counter()
        for r in results:
            kinds.update(r.kinds)
        total = sum(kinds.values())
        lines.append(f"{label}. how the next task of a key got its slot: "
                     + "; ".join(f"{k} {v / total:.0%}" for k, v in kinds.most_common()))
        overlaps = sum(r.overlaps for r in results)
        lines.append(f"{label}. overlapping tasks of one key (K = 1 violated): {overlaps}")
        worst = sorted((g for r in results for g in r.gaps), reverse=True)[:5]
        lines.append(f"{label}. largest handoffs: " + ", ".join(f"{g * 1000:.1f} ms ({k})" for g, k in worst))
    for r in d_results:
        critical = max(r.per_key.values())
        lines.append(f"d. run: makespan {r.makespan:.3f} s; longest key's summed task time {critical:.3f} s "
                     f"(makespan / that = {r.makespan / critical:.3f}); the ledger had all {r.tasks} "
                     f"arrivals at +{r.recorded_after:.2f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
