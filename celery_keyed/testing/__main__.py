"""``python -m celery_keyed.testing``: start a PostgreSQL and a Redis, print ``export`` lines, wait for Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time

from celery_keyed.testing.postgres import start_postgres
from celery_keyed.testing.redis import start_redis
from celery_keyed.testing.servers import BROKER_URL_ENV, DATABASE_URL_ENV


def main() -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with contextlib.ExitStack() as servers:
        started = time.monotonic()
        postgres = servers.enter_context(start_postgres())
        redis = servers.enter_context(start_redis())
        print(f"export {DATABASE_URL_ENV}={postgres.url}")
        print(f"export {BROKER_URL_ENV}={redis.url}")
        print(
            f"# PostgreSQL pid {postgres.pid}, Redis pid {redis.pid}; started in "
            f"{time.monotonic() - started:.2f}s. Ctrl-C stops both.",
            flush=True,
        )
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
