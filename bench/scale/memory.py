"""bench.scale's second measure: a real worker's memory with 100,000 parked attempts against none."""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.scale.ledgers import FILL_NAME, Server, fill, load, spread_key

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
