"""procrastinate with ``lock=`` on the same PostgreSQL: each job is deferred with ``lock=<key>`` (procrastinate
runs at most one job of a lock at a time, in defer order). Variants: ``procrastinate`` (its default
``fetch_job_polling_interval``, 5 s) and ``procrastinate-0.1`` (0.1 s). K = 1 only. Our own code.

Workers: ``python -m bench.peers.sys_procrastinate worker`` (concurrency 4; a sync task runs in a thread);
publisher: ``... publish < spec.json``; ``... schema`` applies procrastinate's schema once.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import procrastinate

from bench.peers import observer as obs

SYSTEM = os.environ.get(obs.ENV_SYSTEM, "procrastinate")
QUEUE = os.environ.get("BENCH_PEERS_QUEUE", "bench_peers")
POLLING = {"procrastinate": None, "procrastinate-0.1": 0.1}


def _conninfo() -> str:
    return os.environ[obs.ENV_DATABASE].replace("postgresql+psycopg://", "postgresql://")


app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=_conninfo()))


@app.task(name="bench_peers_run", queue=QUEUE)
def run_task(run: str, key: str, task_id: str, seconds: float, limit: int) -> None:
    obs.work(run, key, task_id, seconds)


async def _publish(spec: dict[str, Any]) -> None:
    async with app.open_async():
        for key, task_id, seconds, limit in spec["tasks"]:
            await run_task.configure(lock=key).defer_async(
                run=spec["run"], key=key, task_id=task_id, seconds=seconds, limit=limit)


async def _worker() -> None:
    options: dict[str, Any] = {"concurrency": 4, "queues": [QUEUE], "install_signal_handlers": True}
    polling = POLLING[SYSTEM]
    if polling is not None:
        options["fetch_job_polling_interval"] = polling
    async with app.open_async():
        obs.ready(os.environ.get(obs.ENV_WORKER, "?"))
        await app.run_worker_async(**options)


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "schema":
        async def apply() -> None:
            async with app.open_async():
                await app.schema_manager.apply_schema_async()
        asyncio.run(apply())
    elif command == "worker":
        asyncio.run(_worker())
    elif command == "publish":
        spec = json.load(sys.stdin)
        started = time.time()
        asyncio.run(_publish(spec))
        print(json.dumps({"published": len(spec["tasks"]), "refused": 0, "seconds": time.time() - started}))
    else:
        raise SystemExit("usage: python -m bench.peers.sys_procrastinate schema|worker|publish")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
