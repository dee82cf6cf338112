"""Dramatiq with ``ConcurrentRateLimiter`` on Redis, as its docs show: the actor takes the limiter of its key
(``limit=K``) around its body; a refused acquire raises ``RateLimitExceeded`` and the Retries middleware
retries the message with its backoff. Variants: ``dramatiq`` (Dramatiq's defaults: 15 s minimum backoff,
20 retries) and ``dramatiq-tuned`` (``min_backoff=100``, ``max_backoff=1000`` ms). Our own code.

Workers: ``dramatiq bench.peers.sys_dramatiq --processes 4 --threads 1`` (``dramatiq_queue_prefetch=1``);
publisher: ``python -m bench.peers.sys_dramatiq publish < spec.json``. A middleware counts every enqueue
(publish, retry, and the move of a delayed message to its queue) and every dead-lettered message.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware
from dramatiq.rate_limits import ConcurrentRateLimiter, RateLimitExceeded
from dramatiq.rate_limits.backends import RedisBackend

from bench.peers import observer as obs

SYSTEM = os.environ.get(obs.ENV_SYSTEM, "dramatiq")
QUEUE = os.environ.get("BENCH_PEERS_QUEUE", "bench_peers")


class Counting(Middleware):
    """Counts the broker traffic and the dead-lettered messages into the observer (not Dramatiq's books)."""

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        run = message.args[0] if message.args else None
        if run:
            obs.count(run, "messages")

    def after_nack(self, broker: Any, message: Any) -> None:
        if message.args:
            obs.count(message.args[0], "failed")

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        obs.ready(f"{os.environ.get(obs.ENV_WORKER, '?')}-{os.getpid()}")


broker = RedisBroker(url=os.environ[obs.ENV_BROKER])
broker.add_middleware(Counting())
dramatiq.set_broker(broker)
backend = RedisBackend(url=os.environ[obs.ENV_BROKER])

OPTIONS: dict[str, Any] = {"min_backoff": 100, "max_backoff": 1000} if SYSTEM == "dramatiq-tuned" else {}


@dramatiq.actor(actor_name="bench_peers_run", queue_name=QUEUE, **OPTIONS)
def run_task(run: str, key: str, task_id: str, seconds: float, limit: int) -> None:
    limiter = ConcurrentRateLimiter(backend, f"bench:dramatiq:{key}", limit=limit)
    try:
        with limiter.acquire():
            obs.work(run, key, task_id, seconds)
    except RateLimitExceeded:
        obs.count(run, "retries")
        raise


def main(argv: list[str]) -> int:
    if argv[:1] != ["publish"]:
        raise SystemExit("usage: python -m bench.peers.sys_dramatiq publish < spec.json")
    spec = json.load(sys.stdin)
    started = time.time()
    for key, task_id, seconds, limit in spec["tasks"]:
        run_task.send(spec["run"], key, task_id, seconds, limit)
    print(json.dumps({"published": len(spec["tasks"]), "refused": 0, "seconds": time.time() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
