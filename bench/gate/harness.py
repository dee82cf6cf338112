"""bench.gate's harness: the servers, the worker subprocesses, the drains and bursts it times, and the rounds that
take turns between plain Celery and the variants (``bench.gate.worker_app.VARIANTS``)."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.gate.worker_app import ENV_OBSERVER, ENV_VARIANT, KEYS, READY_LIST, VARIANTS, make_app
from bench.procs import stop_group

ROOT = Path(__file__).resolve().parents[2]
WORKER_APP = "bench.gate.worker_app"  # the module workers load (-A); a probe may wrap it
#: Arrivals the ledger has recorded, by primary key (the task ids the run published): an index probe per id. A
#: scan by ``key`` (no index) every 10 ms cost ~3 ms each, ~14 % of a core during the burst it was timing.
ARRIVED_SQL = "SELECT count(*) FROM keyed_tasks WHERE task_id = ANY(CAST(:ids AS text[]))"
LEDGER_POLL = 0.05  # seconds between two looks at the ledger while it has not recorded every arrival
#: Claims the ledger still holds of the given task ids (by primary key).
HELD_SQL = "SELECT count(*) FROM keyed_claims WHERE task_id = ANY(CAST(:ids AS text[]))"


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

    def wait_released(self, ids: list[str], timeout: float) -> int:
        """Wait (at most ``timeout`` s) until the ledger holds no claim of ``ids``; how many it still holds."""
        import sqlalchemy as sa

        deadline = time.monotonic() + timeout
        while True:
            with self.ledger.connect() as conn:
                held = int(conn.execute(sa.text(HELD_SQL), {"ids": ids}).scalar_one())
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(LEDGER_POLL)

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
        stop_group(self.proc, 20.0)


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
    ids = bench.publish(variant, task, queue, calls)
    with bench.workers(variant, queue, [bench.tag(variant)], 2, wait_ready=False) as ws:
        window = CpuWindow(n, ws[0].proc.pid, pids)
        bench.wait_for(run, n, ws, timeout=max(120.0, n / 20), progress=window.progress)
        published = bench.lpush_calls() - before
        if VARIANTS[variant].loop_calls:  # the loop's calls are not flushed at a worker's stop: let them finish
            bench.wait_released(ids, timeout=30.0)
    if VARIANTS[variant].loop_calls:  # what the loop's calls did (bench/gate/loop_releases.py)
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
    #: The makespan through the key that ended last, in parts that add up to it (seconds): its first start after the
    #: run's first start ("offset"), its tasks' summed run time ("tasks"), its handoffs while the ledger had not yet
    #: recorded every arrival ("burst": the workers still parking the burst) and after ("steady"); "n_burst" and
    #: "n_steady" count those handoffs.
    last_key: dict[str, float] = field(default_factory=dict)


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
    last = max(by_key.values(), key=lambda intervals: max(end for _, end, *_ in intervals))
    last_key = {"offset": last[0][0] - first, "tasks": sum(e - s for s, e, *_ in last), "burst": 0.0, "steady": 0.0,
                "n_burst": 0, "n_steady": 0}
    for prev, nxt in itertools.pairwise(last):
        part = "steady" if prev[1] >= recorded else "burst"
        last_key[part] += max(0.0, nxt[0] - prev[1])
        last_key[f"n_{part}"] += 1
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
        last_key=last_key,
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
    """``pairs`` pairs of a worker of A (plain) and one of ``second`` (B, or A again for the A/A control), each in
    turn first (``ratio_rounds``)."""
    return ratio_rounds(bench, pairs, task, n, keyed_args, [label], [second])[0]


def ratio_rounds(bench: Bench, rounds: int, task: str, n: int, keyed_args: bool, labels: list[str],
                 seconds: list[str]) -> list[Pairs]:
    """``rounds`` rounds of a worker of A (plain) and one of each of ``seconds``: each one's ratio to the A of its own
    round, one ``Pairs`` per variant. The order turns every round (round r starts with the r-th of A and the
    ``seconds``, and goes on from there): on this machine a drain that follows another ran slower than the one before
    it even when both were plain Celery (an A/A control, A first in every pair: median 0.87), so a variant always run
    after A would carry that bias in its ratio; in turns, each of them takes every place alike over ``1 +
    len(seconds)`` rounds."""
    outs = [Pairs() for _ in seconds]
    variants = ["plain", *seconds]  # index 0: A
    for p in range(rounds):
        turn = p % len(variants)
        measured: dict[int, tuple[float, float, dict[str, float] | None]] = {}
        for i in [*range(turn, len(variants)), *range(turn)]:
            measured[i] = throughput(bench, variants[i], task, n, keyed_args=keyed_args)
        a, _, cpu_a = measured[0]
        first = "A" if turn == 0 else ("A again" if variants[turn] == "plain" else VARIANTS[variants[turn]].title)
        for i, (label, second, out) in enumerate(zip(labels, seconds, outs, strict=True), start=1):
            b, per_task, cpu_b = measured[i]
            out.rates.append((a, b))
            out.ratios.append(b / a)
            out.published.append(per_task)
            out.cpu.append((cpu_a, cpu_b))
            name = "A again" if second == "plain" else VARIANTS[second].title
            cpu = "".join(f", CPU {cpu['total']:.2f} ms/task" if cpu else "" for cpu in (cpu_a, cpu_b))
            print(f"  {label} pair {p + 1}: A plain {a:6.0f} tasks/s, {name} {b:6.0f} tasks/s, ratio {b / a:.3f}{cpu} "
                  f"({first} first)", flush=True)
    return outs


# -- the servers ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def servers() -> Iterator[tuple[str, str, str]]:
    """(ledger URL of a fresh migrated database, broker URL, description)."""
    from bench.ledger import fresh_database
    from celery_keyed.testing import start_postgres, start_redis

    with start_postgres(durable=True) as pg, start_redis() as rd, fresh_database(pg, "keyed_bench_gate") as (
        url, shown
    ):
        described = (f"PostgreSQL {shown['server_version']} (fsync={shown['fsync']}, "
                     f"{'started by the benchmark' if pg.managed else 'KEYED_DATABASE_URL'}), Redis "
                     f"{'started by the benchmark' if rd.managed else 'CELERY_BROKER_URL'}")
        yield url, rd.url, described
