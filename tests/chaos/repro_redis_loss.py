"""Does plain Celery on the Redis broker lose tasks published around a Redis outage?

No celery-keyed in the workers: they run a small Celery app written to a temporary directory (``acks_late``,
``task_reject_on_worker_lost``, prefork ``-c 2``, tasks sleeping 10-200 ms), started with
``app.Worker(...).start()`` (not the ``celery`` command, whose plugin entry points would import
``celery_keyed.cli``), and assert that ``celery_keyed`` is not imported (unless ``--patch``). The only
celery-keyed code used is ``celery_keyed.testing`` in this process, for two throwaway persistent Redis servers
(append-only file, ``appendfsync always``): the broker, which is stopped (``suspend``, SIGTERM) and started
again (``resume``) ``--cycles`` times at random instants (2-6 s down, 3-8 s up), and the result backend, which
is never stopped (a result is not lost with the broker).

The producer (this process) publishes ``--rate`` tasks a second, each with a unique id, through
``apply_async`` with Celery's default retry policy; when ``apply_async`` raises, it publishes the same id again
after 0.5 s (like tests/chaos/harness.py) and records the attempts. Broker options as tests/chaos/proj.py:
``visibility_timeout`` ``--visibility`` (6 s), ``unacked_restore_interval`` 1. A worker that exits by itself
is started again.

After the last outage the producer stops and the run drains (until every id has a result, or ``--drain``
seconds, at least the visibility timeout and a few restore rounds). A task id without a result is lost. For
each one the report gives: publish attempts and errors, the publish time relative to the nearest outage
(suspend issued / Redis down / resume issued / Redis up), whether a worker logged ``received`` for it,
what the workers' trace saw (``--trace``, on by default: a wrapper around kombu's virtual
``Transport._deliver`` logs each message the consumer took from Redis and any exception raised while
delivering it; it only logs, it changes nothing), and where it ended in Redis: the ``celery`` queue
(``LRANGE``), the ``unacked`` hash (``HGETALL``), and whether the append-only file holds its ``LPUSH``
(published) and an ``HSET unacked`` (recorded as delivered).

    .venv/bin/python tests/chaos/repro_redis_loss.py [--cycles 30] [--seed 1] [--rate 20] [--patch]

``--patch`` makes the workers call ``celery_keyed.compat.patch_kombu_redis_close()`` at import of the app
(it prevents the worker crash on reconnect, see tests/chaos/repro_kombu_close.py).

Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

APP = r"""
import os, random, sys, time
from celery import Celery

if os.environ.get("REPRO_PATCH") == "1":
    from celery_keyed.compat import patch_kombu_redis_close
    print("REPRO: patched:", patch_kombu_redis_close(), flush=True)
if os.environ.get("REPRO_TRACE") == "1":  # log each message taken from Redis, and a failed delivery (only logs)
    import logging

    from kombu.transport.virtual import base as vbase

    log = logging.getLogger("repro")
    _deliver = vbase.Transport._deliver

    def _id(message):
        try:
            return (message.get("headers") or {}).get("id") or "-"
        except Exception:
            return "?"

    def traced_deliver(self, message, queue):
        tid = _id(message)
        log.warning("REPRO-POP %s %.6f queue=%s", tid, time.clock_gettime(time.CLOCK_MONOTONIC), queue)
        try:
            return _deliver(self, message, queue)
        except BaseException as exc:
            log.warning("REPRO-DELIVER-FAILED %s %.6f %r", tid, time.clock_gettime(time.CLOCK_MONOTONIC), exc)
            raise

    vbase.Transport._deliver = traced_deliver

app = Celery("repro_app", broker=os.environ["REPRO_BROKER"], backend=os.environ["REPRO_BACKEND"])
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=int(os.environ.get("REPRO_PREFETCH", "1")),
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    broker_transport_options={
        "visibility_timeout": float(os.environ["REPRO_VISIBILITY"]),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    result_backend_always_retry=True,
    result_backend_max_retries=120,
)


@app.task(name="repro_app.work")
def work(i, seconds):
    time.sleep(seconds)
    return i


if __name__ == "__main__":
    if os.environ.get("REPRO_PATCH") != "1":
        assert "celery_keyed" not in sys.modules, "plain Celery only"
    worker = app.Worker(
        hostname=sys.argv[1], pool_cls="prefork", concurrency=2, loglevel="INFO",
        without_gossip=True, without_mingle=True, without_heartbeat=True,
    )
    worker.start()
    sys.exit(worker.exitcode)
"""


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def resp_commands(data: bytes):  # type: ignore[no-untyped-def]
    """The commands of an append-only file (RESP arrays); an RDB preamble or a torn tail is skipped."""
    pos = data.find(b"*")
    while 0 <= pos < len(data):
        try:
            end = data.index(b"\r\n", pos)
            n = int(data[pos + 1 : end])
            pos = end + 2
            parts = []
            for _ in range(n):
                end = data.index(b"\r\n", pos)
                size = int(data[pos + 1 : end])
                parts.append(data[end + 2 : end + 2 + size])
                pos = end + 2 + size + 2
            yield parts
        except ValueError:
            pos = data.find(b"*", pos + 1)


def aof_ids(directory: Path) -> tuple[set[str], set[str]]:
    """Task ids of the ``LPUSH`` to a queue and of the ``HSET unacked`` records of the append-only file(s)."""
    lpush: set[str] = set()
    hset: set[str] = set()
    files = sorted(p for p in directory.rglob("*.aof*") if p.is_file() and not p.name.endswith(".manifest"))
    for path in files:
        for cmd in resp_commands(path.read_bytes()):
            name = cmd[0].upper() if cmd else b""
            try:
                if name == b"LPUSH":
                    for raw in cmd[2:]:
                        lpush.add(json.loads(raw)["headers"]["id"])
                elif name == b"HSET" and cmd[1] == b"unacked":
                    for raw in cmd[3::2]:
                        hset.add(json.loads(raw)[0]["headers"]["id"])
            except (ValueError, KeyError, IndexError, TypeError):
                pass
    return lpush, hset


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=20.0, help="tasks published a second")
    parser.add_argument("--prefetch", type=int, default=1, help="worker_prefetch_multiplier")
    parser.add_argument("--visibility", type=float, default=6.0, help="visibility_timeout of the broker")
    parser.add_argument("--drain", type=float, default=60.0, help="longest wait for the last results")
    parser.add_argument("--patch", action="store_true", help="apply celery_keyed.compat in the workers")
    parser.add_argument("--no-trace", dest="trace", action="store_false", help="no REPRO-POP trace in workers")
    parser.add_argument("--keep", action="store_true", help="keep the log directory")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    sys.path.insert(0, str(ROOT))
    import redis
    from celery import Celery

    from celery_keyed.testing import start_redis

    work = Path(tempfile.mkdtemp(prefix="repro-redis-loss-"))
    (work / "repro_app.py").write_text(APP)
    broker = start_redis(use_env=False, persistent=True)
    backend = start_redis(use_env=False, persistent=True)
    env = dict(
        os.environ,
        REPRO_BROKER=broker.url,
        REPRO_BACKEND=backend.url,
        REPRO_VISIBILITY=str(args.visibility),
        REPRO_PREFETCH=str(args.prefetch),
        PYTHONPATH=f"{work}{os.pathsep}{ROOT}" if args.patch else str(work),
    )
    env.pop("CELERY_BROKER_URL", None)
    env.pop("CELERY_RESULT_BACKEND", None)
    if args.patch:
        env["REPRO_PATCH"] = "1"
    if args.trace:
        env["REPRO_TRACE"] = "1"

    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: list[Path] = []
    deaths: list[str] = []
    gen = {f"w{i}": 0 for i in range(args.workers)}
    stop_supervise = threading.Event()
    stop_produce = threading.Event()
    lock = threading.Lock()
    # outage events: (kind, time); kinds: suspend (issued), down (returned), resume (issued), up (returned)
    events: list[tuple[str, float]] = []
    published: dict[str, dict[str, object]] = {}

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
        while not stop_supervise.wait(0.5):
            with lock:
                for name, proc in list(procs.items()):
                    if proc.poll() is not None:
                        text = proc.log.read_text(errors="replace")  # type: ignore[attr-defined]
                        hit = re.findall(r"Unrecoverable error: (.*)", text)
                        deaths.append(
                            f"{name} exited {proc.returncode} at {now() - t0:.1f}s: "
                            f"{hit[-1] if hit else '(no Unrecoverable)'}"
                        )
                        print(f"  DEATH {deaths[-1]}", flush=True)
                        start(name)

    producer_app = Celery("producer", broker=broker.url, backend=backend.url, set_as_current=False)
    producer_app.conf.broker_connection_retry_on_startup = True

    def produce() -> None:
        seq = 0
        spacing = 1.0 / args.rate
        t_next = now()
        while not stop_produce.is_set():
            task_id = f"t{seq:05d}-{uuid.uuid4().hex[:12]}"
            rec: dict[str, object] = {"seq": seq, "attempts": [], "errors": []}
            published[task_id] = rec
            while True:
                t_start = now()
                try:
                    producer_app.send_task("repro_app.work", args=(seq, rng_task.uniform(0.01, 0.2)), task_id=task_id)
                    rec["attempts"].append((t_start, now()))  # type: ignore[attr-defined]
                    break
                except Exception as exc:  # broker down: the same id again (a duplicate is normal input)
                    rec["attempts"].append((t_start, now()))  # type: ignore[attr-defined]
                    rec["errors"].append(repr(exc)[:160])  # type: ignore[attr-defined]
                    time.sleep(0.5)
            seq += 1
            t_next += spacing
            delay = t_next - now()
            if delay > 0:
                time.sleep(delay)
            else:
                t_next = now()

    rng_task = random.Random(args.seed * 31 + 7)
    rb = redis.Redis.from_url(broker.url, socket_timeout=2, socket_connect_timeout=2)
    rres = redis.Redis.from_url(backend.url, socket_timeout=5, socket_connect_timeout=5)

    def probe(fn):  # type: ignore[no-untyped-def]
        try:
            return fn()
        except redis.RedisError:
            return "?"

    def results(ids: list[str]) -> set[str]:
        done: set[str] = set()
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            vals = rres.mget([f"celery-task-meta-{t}" for t in chunk])
            done.update(t for t, v in zip(chunk, vals, strict=True) if v is not None)
        return done

    def received(logs: list[Path]) -> dict[str, int]:
        seen: dict[str, int] = {}
        for p in logs:
            for m in re.finditer(r"Task repro_app\.work\[([^\]]+)\] received", p.read_text(errors="replace")):
                seen[m.group(1)] = seen.get(m.group(1), 0) + 1
        return seen

    t0 = now()
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
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        time.sleep(rng.uniform(3, 6))
        for cycle in range(args.cycles):
            down = rng.uniform(2, 6)
            events.append(("suspend", now()))
            broker.suspend()
            events.append(("down", now()))
            print(f"cycle {cycle + 1}/{args.cycles} at {now() - t0:.1f}s: Redis down {down:.1f}s", flush=True)
            time.sleep(down)
            events.append(("resume", now()))
            broker.resume()
            events.append(("up", now()))
            time.sleep(rng.uniform(3, 8))
            ids = list(published)
            print(
                f"  published {len(ids)} done {len(results(ids))} queued {probe(lambda: rb.llen('celery'))} "
                f"unacked {probe(lambda: rb.hlen('unacked'))}",
                flush=True,
            )
        stop_produce.set()
        producer.join(timeout=30)
        ids = list(published)
        drain_until = now() + max(args.drain, args.visibility + 10)
        while now() < drain_until:
            missing = set(ids) - results(ids)
            if not missing:
                break
            time.sleep(1)
        done = results(ids)
        lost = [t for t in ids if t not in done]
        print(f"\ndrained at {now() - t0:.1f}s", flush=True)

        # Where did the lost ones end?  Queue, unacked hash, append-only file (before the server is removed).
        queue_ids: set[str] = set()
        for raw in rb.lrange("celery", 0, -1):
            with contextlib.suppress(Exception):
                queue_ids.add(json.loads(raw)["headers"]["id"])
        unacked_ids: set[str] = set()
        for raw in rb.hgetall("unacked").values():
            with contextlib.suppress(Exception):
                unacked_ids.add(json.loads(raw)[0]["headers"]["id"])
        lpush_ids, hset_ids = aof_ids(Path(broker.tmpdir))
        lpush_ids_s, hset_ids_s = lpush_ids, hset_ids
        seen = received(logs)
        pops: dict[str, list[str]] = {}
        for p in logs:
            for line in p.read_text(errors="replace").splitlines():
                m = re.search(r"REPRO-(POP|DELIVER-FAILED) (\S+) ([\d.]+)(.*)", line)
                if m:
                    pops.setdefault(m.group(2), []).append(
                        f"{p.stem} {m.group(1)} at {float(m.group(3)) - t0:.3f}s{m.group(4)[:140]}"
                    )
    finally:
        stop_produce.set()
        stop_supervise.set()
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
            for proc in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        broker.stop()
        backend.stop()

    times = [t for _, t in events]

    def relative(t: float) -> str:
        """Where ``t`` falls among the outage events: the nearest ones before and after."""
        i = bisect.bisect_right(times, t)
        parts = []
        if i > 0:
            parts.append(f"{t - times[i - 1]:+.3f}s after {events[i - 1][0]} #{(i - 1) // 4 + 1}")
        if i < len(times):
            parts.append(f"{times[i] - t:.3f}s before {events[i][0]} #{i // 4 + 1}")
        return "; ".join(parts)

    retried = sum(1 for r in published.values() if r["errors"])
    print(f"\npublished {len(published)} task ids ({retried} needed more than one apply_async), "
          f"lost (no result) {len(lost)}; outages {args.cycles}; patch {args.patch}; seed {args.seed}")
    print(f"worker deaths: {len(deaths)}")
    for d in deaths:
        print("  ", d)
    by_seq = {int(r["seq"]): t for t, r in published.items()}  # type: ignore[call-overload]
    for t in lost:
        rec = published[t]
        attempts = rec["attempts"]
        print(f"\nLOST {t}")
        for n, (a, b) in enumerate(attempts):  # type: ignore[attr-defined]
            err = rec["errors"][n] if n < len(rec["errors"]) else "ok"  # type: ignore[arg-type]
            print(f"  apply_async #{n + 1} at {a - t0:.3f}s took {b - a:.3f}s: {err}  [{relative(a)}]")
        where = [name for name, s in (("queue", queue_ids), ("unacked", unacked_ids)) if t in s] or ["nowhere"]
        print(f"  in Redis after drain: {', '.join(where)}; AOF LPUSH: {t in lpush_ids_s}, "
              f"AOF HSET unacked: {t in hset_ids_s}; worker 'received' lines: {seen.get(t, 0)}")
        for line in pops.get(t, []):
            print(f"  trace: {line}  [{relative(float(line.split(' at ')[1].split('s')[0]) + t0)}]")
        if not pops.get(t):  # the queue is FIFO: its neighbours' first pops bracket the moment it was popped
            seq = int(rec["seq"])  # type: ignore[call-overload]
            for label, step in (("previous", -1), ("next", 1)):
                for other in range(seq + step, seq + 50 * step, step):
                    tid = by_seq.get(other)
                    if tid and pops.get(tid):
                        line = pops[tid][0]
                        at = float(line.split(" at ")[1].split("s")[0]) + t0
                        print(f"  {label} traced id {tid}: {line}  [{relative(at)}]")
                        break
    # pops that failed (for any id, lost or not)
    failed = [(t, line) for t, lines in pops.items() for line in lines if "DELIVER-FAILED" in line]
    print(f"\ndelivery failures traced in workers: {len(failed)} "
          f"(of them lost: {sum(1 for t, _ in failed if t in set(lost))})")
    for t, line in failed[:20]:
        print(f"  {t}: {line}")
    print(f"ids published and in AOF LPUSH: {len(lpush_ids_s & set(published))}/{len(published)}")
    print(f"logs: {work}" if args.keep or lost or deaths else "")
    if not (args.keep or lost or deaths):
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
