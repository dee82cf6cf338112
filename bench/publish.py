"""What a keyed publish costs a producer, with and without the outbox, side by side in one run.

    python -m bench.publish [--quick] [--tasks 2000] [--pairs 5]

Publishes ``--tasks`` keyed calls (``bench.gate``'s ``keyed_noop`` on 1,000 keys) from this process to a queue no
worker consumes, with ``apply_async`` and the app's producer pool, in four ways, interleaved in rounds:

- **celery**: the same function and arguments as a plain Celery task (no celery-keyed): the baseline;
- **plain**: a keyed task published as today (no ledger call at publish: the gate learns of it at receipt);
- **outbox**: ``keyed_register_at_publish=True``: each message stored in the ledger, in a transaction of its own
  (one round trip and one commit each, on a durable PostgreSQL), then published;
- **outbox in a transaction**: ``keyed_connection=conn`` inside one ``engine.begin()`` per batch of 100 calls, as an
  application publishing from its own transaction does: the messages are stored with the caller's commit, and
  published by the relay once committed (here: ``relay_outbox`` right after each commit, timed with it).

Reports calls per second (median of the rounds, with min-max), each variant's time per call against the plain
Celery publish of the same round (1.00 = as fast; the target for a keyed publish without the outbox is at most 1.2),
and p50 / p99 of one call's latency. Servers: a durable PostgreSQL (fsync on) and a Redis started by the benchmark
(``celery_keyed.testing``) unless ``KEYED_DATABASE_URL`` / ``CELERY_BROKER_URL`` name servers. A run holds
``flock $HOME/.celery-keyed-bench.lock`` and records the load average before and after. Benchmarks are not tests:
nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from typing import Any

from bench.gate import harness as bg_harness
from bench.gate import worker_app as bg
from bench.procs import run_locked

BATCH = 100  # calls per caller transaction (the third variant)
VARIANTS = ("celery", "plain", "outbox", "outbox-tx")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(app: Any, variant: str, n: int, engine: Any, celery_app: Any = None) -> tuple[float, list[float]]:
    """Publish ``n`` calls the ``variant`` way: (calls per second, per-call latencies in seconds). ``celery_app``:
    the app without celery-keyed whose task the "celery" variant publishes."""
    from celery_keyed.ledger import Ledger
    from celery_keyed.publisher import relay_outbox

    task = (celery_app if variant == "celery" else app).bench_tasks["keyed_noop"]
    queue = f"bench-publish-{uuid.uuid4().hex[:8]}"  # no worker consumes it
    run_id = uuid.uuid4().hex[:8]
    latencies: list[float] = []
    started = time.perf_counter()
    if variant == "outbox-tx":
        ledger = Ledger(engine)
        for start in range(0, n, BATCH):
            with engine.begin() as conn:
                for i in range(start, min(n, start + BATCH)):
                    t0 = time.perf_counter()
                    task.apply_async((run_id, i % bg.KEYS), queue=queue, keyed_connection=conn,
                                     keyed_register_at_publish=True)
                    latencies.append(time.perf_counter() - t0)
            relay_outbox(app, ledger, arrival_timeout=3600.0)  # publish what the commit made due
    else:
        options: dict[str, Any] = {"keyed_register_at_publish": True} if variant == "outbox" else {}
        for i in range(n):
            t0 = time.perf_counter()
            task.apply_async((run_id, i % bg.KEYS), queue=queue, **options)
            latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    return n / elapsed, latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.publish", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run: 500 calls, 2 pairs")
    parser.add_argument("--tasks", type=int, help="calls per run (default 2000, quick 500)")
    parser.add_argument("--pairs", type=int, help="interleaved rounds of the four variants (default 5, quick 2)")
    parser.add_argument("--lock-wait", type=float, help="give up after this many seconds waiting for the lock")
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(raw)
    run_locked("bench.publish", raw, args.lock_wait)
    n = args.tasks or (500 if args.quick else 2000)
    pairs = args.pairs or (2 if args.quick else 5)
    import sqlalchemy as sa

    load0 = os.getloadavg()
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS[1:]}
    lat: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with bg_harness.servers() as (database_url, broker_url, described):
        app = bg.make_app("keyed", broker_url, database_url, broker_url)
        app.conf.keyed_send_arrival_timeout = 3600.0  # nothing consumes the queue: nothing is due for republishing
        celery_app = bg.make_app("plain", broker_url, database_url, broker_url)
        engine = sa.create_engine(database_url, pool_size=2, max_overflow=0)
        try:
            run(app, "celery", 200, engine, celery_app)  # warm-up: connections, producer pool, prepared statements
            run(app, "plain", 200, engine)
            run(app, "outbox", 200, engine)
            for pair in range(pairs):
                order = VARIANTS if pair % 2 == 0 else tuple(reversed(VARIANTS))
                got: dict[str, float] = {}
                for variant in order:
                    rate, latencies = run(app, variant, n, engine, celery_app)
                    got[variant] = rate
                    rates[variant].append(rate)
                    lat[variant] += latencies
                for variant in VARIANTS[1:]:
                    ratios[variant].append(got["celery"] / got[variant])  # time per call against Celery's
                print(f"pair {pair + 1}/{pairs}: " + ", ".join(f"{v} {got[v]:.0f}/s" for v in VARIANTS), flush=True)
        finally:
            engine.dispose()
    load1 = os.getloadavg()

    def spread(values: list[float], fmt: str) -> str:
        return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"

    print(f"\n`python -m bench.publish {' '.join(raw)}`".rstrip() + f": {n} calls per run, {pairs} pairs. {described}.")
    print(f"Load average (1 / 5 / 15 min): {' / '.join(f'{x:.2f}' for x in load0)} before, "
          f"{' / '.join(f'{x:.2f}' for x in load1)} after.\n")
    print("| variant | calls/s | time per call / plain Celery's (same round) | call p50 ms | call p99 ms |")
    print("|---|---:|---:|---:|---:|")
    labels = {"celery": "plain Celery (the same function, no celery-keyed)", "plain": "keyed, no outbox",
              "outbox": "keyed_register_at_publish (own transaction)",
              "outbox-tx": f"keyed_connection (caller's transaction of {BATCH} calls, then the relay)"}
    for variant in VARIANTS:
        ratio = "1.00" if variant == "celery" else spread(ratios[variant], ".2f")
        print(f"| {labels[variant]} | {spread(rates[variant], '.0f')} | {ratio} | "
              f"{pct(lat[variant], 0.5) * 1000:.2f} | {pct(lat[variant], 0.99) * 1000:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
