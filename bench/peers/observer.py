"""The independent observer, shared by every system's worker code (only the standard library and redis-py).

A task body records its own start and end (``time.time()``, taken where the body runs) with one RPUSH to the
run's list: ``"start end key task_id pid"``. Counters (retries, refusals, failures, messages) go to the run's
hash with HINCRBY. None of this reads any system's own books.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

ENV_SYSTEM = "BENCH_PEERS_SYSTEM"  # which variant a worker / publisher runs
ENV_OBSERVER = "BENCH_PEERS_OBSERVER"  # Redis URL of the observer lists
ENV_BROKER = "BENCH_PEERS_BROKER"  # Redis URL of the system's broker (Celery, Dramatiq)
ENV_DATABASE = "BENCH_PEERS_DATABASE"  # PostgreSQL URL (celery-keyed's ledger, procrastinate, PgQueuer)
ENV_KEYS = "BENCH_PEERS_KEYS"  # PgQueuer: path of a JSON {key: K} fixed when the workers start
ENV_WORKER = "BENCH_PEERS_WORKER"  # the worker's name
READY = "bench:peers:ready"  # worker names, pushed when a worker (process) is ready

_clients: dict[tuple[int, int, str], Any] = {}
_lock = threading.Lock()


def client(url: str | None = None) -> Any:
    """One Redis client per process and thread (pool processes are forked: never share the parent's socket)."""
    url = url or os.environ[ENV_OBSERVER]
    ident = (os.getpid(), threading.get_ident(), url)
    found = _clients.get(ident)
    if found is None:
        import redis

        with _lock:
            found = _clients[ident] = redis.Redis.from_url(url)
    return found


def stats_key(run: str) -> str:
    return f"{run}:stats"


def record(run: str, key: str, task_id: str, started: float, ended: float) -> None:
    client().rpush(run, f"{started:.6f} {ended:.6f} {key} {task_id} {os.getpid()}")


def count(run: str, what: str, n: int = 1) -> None:
    client().hincrby(stats_key(run), what, n)


def work(run: str, key: str, task_id: str, seconds: float) -> None:
    """The task body every system runs: sleep ``seconds`` (0 = a trivial task) and record start and end."""
    started = time.time()
    if seconds > 0:
        time.sleep(seconds)
    record(run, key, task_id, started, time.time())


def ready(name: str) -> None:
    client().rpush(READY, name)
