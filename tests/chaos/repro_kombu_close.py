"""Reproduce kombu's ``AttributeError: 'NoneType' object has no attribute 'hostname'`` with plain Celery.

No celery-keyed in the workers: they run a ten-line Celery app written to a temporary directory (Redis broker
and result backend, ``acks_late``, ``task_reject_on_worker_lost``, prefork ``-c 2``, tasks sleeping 0.2-2 s).
The only celery-keyed code used is ``celery_keyed.testing`` in this process, to start a throwaway persistent
Redis (it imports neither Celery nor the rest of celery-keyed). The workers are started with
``app.Worker(...).start()`` rather than the ``celery`` command, whose plugin entry points would import
``celery_keyed.cli``, and assert that ``celery_keyed`` is not imported (unless ``--patch``). The worker options
are the chaos harness's: prefork ``-c 2``, without gossip, mingle and heartbeat.

A producer keeps ``--queued`` tasks queued while Redis is stopped and started again ``--cycles`` times (2-6 s
down, 3-6 s up). A worker that exits by itself is counted, its log searched for ``Unrecoverable error``, and
it is started again.

The crash needs a ``BRPOP`` pending on the worker's task channel when the connection error surfaces, and
unacknowledged messages on that channel: a worker below its prefetch limit with tasks running. Hence the
default of 2 queued tasks for 2 workers of prefetch 8: seeds 21, 22 and 25 (20 outages each) gave 6, 4 and 2
deaths, and 0 with ``--patch``; with ``--queued 20`` the workers sit at their prefetch limit (no ``BRPOP``
pending) and 80 outages gave none. ``--trace`` logs, in the workers, what ``collect()`` leaves open and which
``close()`` raised.

    .venv/bin/python tests/chaos/repro_kombu_close.py [--cycles 20] [--seed 1] [--workers 2] [--patch]

``--patch`` makes the workers call ``celery_keyed.compat.patch_kombu_redis_close()`` at import of the app
(the workaround): the count of deaths with ``'hostname'`` must then be 0.

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

APP = """
import os, random, sys, time
from celery import Celery

if os.environ.get("REPRO_PATCH") == "1":
    from celery_keyed.compat import patch_kombu_redis_close
    print("REPRO: patched:", patch_kombu_redis_close(), flush=True)
if os.environ.get("REPRO_TRACE") == "1":  # log what kombu leaves behind when closing a broken connection
    import logging

    from kombu.connection import Connection
    from kombu.transport import redis as kredis

    log = logging.getLogger("repro")
    _collect, _close = Connection.collect, kredis.Channel.close

    def collect(self, *args, **kwargs):
        channels = list(getattr(self._transport, "channels", None) or [])
        try:
            return _collect(self, *args, **kwargs)
        finally:
            d = self._default_channel
            log.warning(
                "REPRO-TRACE after collect(): default channel %s closed=%s transport.client=%s; "
                "channels still open: %s",
                id(d), getattr(d, "closed", None), getattr(getattr(d, "connection", None), "client", "-"),
                [id(c) for c in channels if not c.closed],
            )

    def close(self):
        try:
            return _close(self)
        except BaseException as exc:
            log.warning("REPRO-TRACE channel %s close() raised %r, closed=%s, unacked=%d",
                        id(self), exc, self.closed, len(self.qos._delivered) if self._qos else 0)
            raise

    Connection.collect, kredis.Channel.close = collect, close

app = Celery("repro_app", broker=os.environ["REPRO_URL"], backend=os.environ["REPRO_URL"])
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    broker_transport_options={"visibility_timeout": 3600},
)


@app.task
def work(i):
    time.sleep(random.uniform(0.2, 2.0))
    return i


if __name__ == "__main__":  # started as a script, not through the celery CLI: its plugins are not loaded
    if os.environ.get("REPRO_PATCH") != "1":
        assert "celery_keyed" not in sys.modules, "plain Celery only"
    worker = app.Worker(
        hostname=sys.argv[1], pool_cls="prefork", concurrency=2, loglevel="INFO",
        without_gossip=True, without_mingle=True, without_heartbeat=True,
    )
    worker.start()
    sys.exit(worker.exitcode)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--queued", type=int, default=2, help="tasks the producer keeps queued (see above)")
    parser.add_argument("--restart", action="store_true", help="restart Redis at once instead of an outage")
    parser.add_argument("--patch", action="store_true", help="apply celery_keyed.compat in the workers")
    parser.add_argument("--trace", action="store_true", help="log the channels kombu leaves open (diagnosis)")
    parser.add_argument("--keep", action="store_true", help="keep the log directory")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    sys.path.insert(0, str(ROOT))
    import redis

    from celery_keyed.testing import start_redis

    work = Path(tempfile.mkdtemp(prefix="repro-kombu-close-"))
    (work / "repro_app.py").write_text(APP)
    server = start_redis(use_env=False, persistent=True)
    env = dict(os.environ, REPRO_URL=server.url, PYTHONPATH=f"{work}{os.pathsep}{ROOT}" if args.patch else str(work))
    if args.patch:
        env["REPRO_PATCH"] = "1"
    if args.trace:
        env["REPRO_TRACE"] = "1"

    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[Path] = []
    deaths: list[str] = []
    gen = {f"w{i}": 0 for i in range(args.workers)}
    stop = threading.Event()
    lock = threading.Lock()

    def start(name: str) -> None:
        log = work / f"{name}.{gen[name]}.log"
        gen[name] += 1
        logs.append(log)
        cmd = [sys.executable, str(work / "repro_app.py"), f"{name}@repro"]
        with open(log, "wb") as out:
            procs[name] = subprocess.Popen(
                cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        procs[name].log = log  # type: ignore[attr-defined]

    def supervise() -> None:
        while not stop.wait(0.5):
            with lock:
                for name, proc in list(procs.items()):
                    if proc.poll() is not None:
                        text = proc.log.read_text(errors="replace")  # type: ignore[attr-defined]
                        hit = re.findall(r"Unrecoverable error: (.*)", text)
                        deaths.append(f"{name} exited {proc.returncode}: {hit[-1] if hit else '(no Unrecoverable)'}")
                        print(f"  DEATH {deaths[-1]}", flush=True)
                        start(name)

    def produce() -> None:
        from celery import Celery

        def producer_app() -> Celery:
            app = Celery("producer", broker=server.url)
            app.conf.broker_connection_retry_on_startup = True
            return app

        app = producer_app()
        r = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
        i = 0
        while not stop.wait(0.1):
            try:
                if r.llen("celery") < args.queued:
                    with app.connection_for_write() as conn:
                        for _ in range(min(5, args.queued)):
                            app.send_task("repro_app.work", args=(i,), connection=conn, retry=False)
                            i += 1
            except Exception:  # Redis is down: a fresh app (and connection) next time
                app = producer_app()

    r = redis.Redis.from_url(server.url, socket_timeout=2, socket_connect_timeout=2)

    def queued(r: redis.Redis) -> object:
        try:
            return r.llen("celery")
        except redis.RedisError:
            return "?"

    def unacked(r: redis.Redis) -> object:
        try:
            return r.hlen("unacked")
        except redis.RedisError:
            return "?"

    def succeeded(logs: list[Path]) -> int:
        return sum(p.read_text(errors="replace").count(" succeeded in ") for p in list(logs))

    try:
        for name in gen:
            start(name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            "ready." in p.log.read_text(errors="replace")  # type: ignore[attr-defined]
            for p in procs.values()
        ):
            time.sleep(0.2)
        threading.Thread(target=supervise, daemon=True).start()
        threading.Thread(target=produce, daemon=True).start()
        time.sleep(4)
        for cycle in range(args.cycles):
            down = rng.uniform(2, 6)
            if args.restart:
                server.restart()
                print(f"cycle {cycle + 1}/{args.cycles}: Redis restarted", flush=True)
            else:
                server.suspend()
                print(f"cycle {cycle + 1}/{args.cycles}: Redis down {down:.1f}s", flush=True)
                time.sleep(down)
                server.resume()
            time.sleep(rng.uniform(3, 6))
            print(f"  queued {queued(r)} unacked {unacked(r)} succeeded {succeeded(logs)}", flush=True)
        time.sleep(3)
    finally:
        stop.set()
        with lock:
            for proc in procs.values():
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            for proc in procs.values():  # orphaned pool children
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        server.stop()

    hostname = [d for d in deaths if "'hostname'" in d]
    print(f"\nworker deaths: {len(deaths)}, of which AttributeError 'hostname': {len(hostname)}")
    for d in deaths:
        print("  ", d)
    print(f"logs: {work}" if args.keep or deaths else "")
    if not (args.keep or deaths):
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if hostname else 0


if __name__ == "__main__":
    sys.exit(main())
