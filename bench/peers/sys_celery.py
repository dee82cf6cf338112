"""The Celery systems of bench.peers, one module for the workers (``celery -A bench.peers.sys_celery worker``)
and the publisher (``python -m bench.peers.sys_celery publish < spec.json``). Our own code, per variant:

- ``plain``: plain Celery, no keys (the ceiling: it does not bound a key).
- ``cookbook`` / ``cookbook-default``: the Celery cookbook's lock taken at task start (a Redis ``SET NX PX``
  for K = 1, a Redis counter semaphore for K > 1, released in ``finally``), ``self.retry(countdown=0.1)`` while
  it is held; ``max_retries=None`` on the task, or Celery's default (3): every MaxRetriesExceededError is
  counted as a failed task.
- ``once``: celery-once's ``QueueOnce`` keyed on the key (``once={"keys": ["key"], "graceful": True}``): a
  publish while the key is queued or running is refused; the publisher counts the refusals. K = 1 only.
- ``keyed``: celery-keyed with its README's recommended settings (``worker_prefetch_multiplier = 1``,
  ``celery_keyed.install(app)``, the K > 1 names configured in ``keyed_concurrency_limits``).

Every variant: acks_late, prefetch 1, result backend disabled (celery-once's lock lives in Redis).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from bench.peers import observer as obs

TASK = "bench.peers.run"
#: Names whose keys have K > 1 (the workloads' names); every other name is a mutex (K = 1).
KEYED_LIMITS = {"w2": {"limit": 4}, "w5": {"limit": 2}}
LOCK_TTL_MS = 60_000

_SEMAPHORE = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(ARGV[1]) then redis.call('DECR', KEYS[1]) return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


def _lock_client() -> Any:
    return obs.client(os.environ[obs.ENV_BROKER])


def acquire(key: str, limit: int) -> bool:
    name = f"bench:lock:{key}"
    if limit == 1:  # the cookbook's lock
        return bool(_lock_client().set(name, "1", nx=True, px=LOCK_TTL_MS))
    return bool(_lock_client().eval(_SEMAPHORE, 1, name, limit, LOCK_TTL_MS))


def release(key: str, limit: int) -> None:
    name = f"bench:lock:{key}"
    if limit == 1:
        _lock_client().delete(name)
    else:
        _lock_client().decr(name)


def make_app(system: str) -> Any:
    from celery import Celery

    app = Celery("bench_peers", set_as_current=False)
    app.conf.update(
        broker_url=os.environ[obs.ENV_BROKER],
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )

    if system == "plain":

        @app.task(name=TASK, bind=True)
        def run_plain(self: Any, run: str, key: str, task_id: str, seconds: float, limit: int) -> None:
            obs.work(run, key, task_id, seconds)

        return app

    if system in ("cookbook", "cookbook-default"):
        from celery.exceptions import MaxRetriesExceededError

        options: dict[str, Any] = {"max_retries": None} if system == "cookbook" else {}

        @app.task(name=TASK, bind=True, **options)
        def run_cookbook(self: Any, run: str, key: str, task_id: str, seconds: float, limit: int) -> None:
            if not acquire(key, limit):
                obs.count(run, "retries")
                try:
                    raise self.retry(countdown=0.1)
                except MaxRetriesExceededError:
                    obs.count(run, "failed")
                    raise
            try:
                obs.work(run, key, task_id, seconds)
            finally:
                release(key, limit)

        return app

    if system == "once":
        from celery_once import QueueOnce

        app.conf.ONCE = {"backend": "celery_once.backends.Redis",
                         "settings": {"url": os.environ[obs.ENV_BROKER], "default_timeout": 600}}

        @app.task(name=TASK, bind=True, base=QueueOnce, once={"keys": ["key"], "graceful": True})
        def run_once(self: Any, run: str, key: str, task_id: str, seconds: float, limit: int) -> None:
            obs.work(run, key, task_id, seconds)

        return app

    if system == "keyed":
        import celery_keyed
        from celery_keyed import keyed_task

        app.conf.update(keyed_database_url=os.environ[obs.ENV_DATABASE], keyed_concurrency_limits=KEYED_LIMITS)
        celery_keyed.install(app)

        @keyed_task(app=app, name=TASK, bind=True, concurrency_key="{key}")
        def run_keyed(self: Any, run: str, key: str, task_id: str, seconds: float, limit: int) -> None:
            obs.work(run, key, task_id, seconds)

        return app

    raise SystemExit(f"unknown Celery system {system!r}")


def publish(app: Any, spec: dict[str, Any]) -> dict[str, int]:
    """Publish every task of the spec, in its order; a refused publish (celery-once) is counted, not retried."""
    task = app.tasks[TASK]
    run = spec["run"]
    refused = 0
    with app.producer_or_acquire() as producer:
        for key, task_id, seconds, limit in spec["tasks"]:
            result = task.apply_async((run, key, task_id, seconds, limit), queue=spec["queue"], producer=producer)
            if getattr(result, "state", None) == "REJECTED":
                refused += 1
    return {"published": len(spec["tasks"]) - refused, "refused": refused}


if os.environ.get(obs.ENV_SYSTEM) and __name__ != "__main__":  # a worker: celery -A bench.peers.sys_celery
    from celery import signals

    app = make_app(os.environ[obs.ENV_SYSTEM])

    @signals.worker_ready.connect(weak=False)
    def _announce(sender: Any = None, **kwargs: Any) -> None:
        obs.ready(os.environ.get(obs.ENV_WORKER, "?"))


def main(argv: list[str]) -> int:
    if argv[:1] != ["publish"]:
        raise SystemExit("usage: python -m bench.peers.sys_celery publish < spec.json")
    spec = json.load(sys.stdin)
    app = make_app(os.environ[obs.ENV_SYSTEM])
    started = time.time()
    out: dict[str, float] = dict(publish(app, spec))
    out["seconds"] = time.time() - started
    app.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
