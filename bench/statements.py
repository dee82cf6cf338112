"""Where the ledger's server time goes, statement by statement: ``python -m bench.statements``.

Starts a durable PostgreSQL of its own (``bench.ledger.bench_database``: a fresh migrated ledger, with bench.ledger's
names and raw tables beside it) with ``pg_stat_statements`` (``track = all``: the statements inside the ledger's
PL/pgSQL functions and triggers are counted too), warms ``--keys`` keys, then runs ``--batches`` rounds of one
``Ledger.admit_many`` of ``--size`` uncontended arrivals and one ``Ledger.release_many`` of their claims on one
connection: the calls a worker's threads make in bench.gate's scenario b. Prints each statement's calls and execution
time per round (µs), the top-level calls first by their total; a statement inside a function is counted inside its
caller's time as well.
"""

from __future__ import annotations

import argparse
import time

import sqlalchemy as sa

from bench.ledger import bench_database
from celery_keyed.ledger import Arrival, Ledger, Outcome, ReleaseRequest, Token

SETTINGS = {
    "shared_preload_libraries": "pg_stat_statements",
    "pg_stat_statements.track": "all",
    "pg_stat_statements.max": "5000",
}

REPORT = sa.text(
    """
    SELECT toplevel, calls, total_exec_time, left(regexp_replace(query, '\\s+', ' ', 'g'), :width) AS query
      FROM pg_stat_statements
     WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND query NOT LIKE '%pg_stat_statements%'
     ORDER BY total_exec_time DESC
     LIMIT :rows
    """
)


def rounds(ledger: Ledger, keys: list[str], tag: str, batches: int, size: int) -> float:
    """``batches`` rounds of a claim of ``size`` arrivals and the release of their claims; seconds of wall time."""
    started = time.perf_counter()
    with ledger.pinned():
        for b in range(batches):
            arrivals = [
                Arrival(task_id=f"{tag}-{b}-{j}", attempt=0, key=keys[(b * size + j) % len(keys)], task_name="t")
                for j in range(size)
            ]
            admitted = ledger.admit_many(arrivals)
            done = zip(arrivals, admitted, strict=True)
            ledger.release_many([ReleaseRequest(Token(a.task_id, 0), d.fence or 0, Outcome.COMPLETED) for a, d in done])
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.statements", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=1500, help="rounds measured (default 1500)")
    parser.add_argument("--size", type=int, default=3, help="arrivals per claim call and releases per call (3)")
    parser.add_argument("--keys", type=int, default=1000, help="uncontended keys, warmed first (1000)")
    parser.add_argument("--rows", type=int, default=25, help="statements shown (25)")
    args = parser.parse_args(argv)
    with bench_database(SETTINGS) as (url, server):
        engine = sa.create_engine(url, pool_size=2)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
            ledger = Ledger(engine, holder="bench-statements")
            keys = [f"k:{i}" for i in range(args.keys)]
            rounds(ledger, keys, "warm", max(1, args.keys // args.size + 100), args.size)
            with engine.begin() as conn:
                conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
            wall = rounds(ledger, keys, "run", args.batches, args.size)
            with engine.connect() as conn:
                rows = conn.execute(REPORT, {"width": 110, "rows": args.rows}).all()
        finally:
            engine.dispose()
    n = args.batches
    print(f"{server}; {n} rounds of a claim of {args.size} and their release, "
          f"{wall / n * 1000:.2f} ms wall per round")
    print("| level | calls per round | µs per round | statement |")
    print("|---|---:|---:|---|")
    for row in rows:
        level = "call" if row.toplevel else "inside"
        query = row.query.replace("|", "\\|")
        print(f"| {level} | {row.calls / n:.2f} | {row.total_exec_time * 1000 / n:.1f} | `{query}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
