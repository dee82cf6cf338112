"""PgQueuer with one entrypoint per key and ``concurrency_limit=K`` (PgQueuer enforces it in SQL across
workers). The key set is fixed when the workers start (``BENCH_PEERS_KEYS``: a JSON ``{key: K}``), so the
harness starts its workers per workload. Our own code.

Workers: ``python -m bench.peers.sys_pgqueuer worker`` (one QueueManager per worker, ``batch_size=2``,
``max_concurrent_tasks=4``: 4 jobs at once, the sync body in a thread); publisher: ``... publish < spec.json``
(one enqueue per task); ``... schema`` installs PgQueuer's schema once. On asyncpg, PgQueuer's own first
driver (with its psycopg driver we measured handoffs of about 1 s: its notification watcher waits on the
connection with a 1 s timeout); on psycopg only when asyncpg is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from pgqueuer import QueueManager
from pgqueuer.queries import Queries

from bench.peers import observer as obs


def _conninfo() -> str:
    return os.environ[obs.ENV_DATABASE].replace("postgresql+psycopg://", "postgresql://")


async def _connect() -> tuple[Any, Any]:
    """(driver, connection)."""
    try:
        import asyncpg
    except ImportError:
        import psycopg
        from pgqueuer.db import PsycopgDriver

        conn = await psycopg.AsyncConnection.connect(_conninfo(), autocommit=True)
        return PsycopgDriver(conn), conn
    from pgqueuer.db import AsyncpgDriver

    conn = await asyncpg.connect(_conninfo())
    return AsyncpgDriver(conn), conn


def _register(qm: QueueManager, key: str, limit: int) -> None:
    @qm.entrypoint(key, concurrency_limit=limit)
    async def handle(job: Any) -> None:
        run, task_id, seconds = json.loads(job.payload)
        await asyncio.to_thread(obs.work, run, key, task_id, seconds)


async def _worker() -> None:
    with open(os.environ[obs.ENV_KEYS]) as f:
        keys: dict[str, int] = json.load(f)
    driver, _conn = await _connect()
    qm = QueueManager(Queries(driver))
    for key, limit in keys.items():
        _register(qm, key, limit)
    obs.ready(os.environ.get(obs.ENV_WORKER, "?"))
    await qm.run(batch_size=2, max_concurrent_tasks=4)


async def _publish(spec: dict[str, Any]) -> None:
    driver, conn = await _connect()
    queries = Queries(driver)
    for key, task_id, seconds, _limit in spec["tasks"]:
        await queries.enqueue(key, json.dumps([spec["run"], task_id, seconds]).encode())
    await conn.close()


async def _schema() -> None:
    driver, conn = await _connect()
    await Queries(driver).install()
    await conn.close()


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "schema":
        asyncio.run(_schema())
    elif command == "worker":
        asyncio.run(_worker())
    elif command == "publish":
        spec = json.load(sys.stdin)
        started = time.time()
        asyncio.run(_publish(spec))
        print(json.dumps({"published": len(spec["tasks"]), "refused": 0, "seconds": time.time() - started}))
    else:
        raise SystemExit("usage: python -m bench.peers.sys_pgqueuer schema|worker|publish")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
