"""Where the ledger's server time goes, statement by statement: ``python -m bench.statements``.

Starts a durable PostgreSQL of its own (``bench.ledger.bench_database``: a fresh migrated ledger, with bench.ledger's
names and raw tables beside it) with ``pg_stat_statements`` (``track = all``: the statements inside the ledger's
PL/pgSQL functions and triggers are counted too), warms ``--keys`` keys, then runs ``--batches`` rounds of one
``Ledger.admit_many`` of ``--size`` uncontended arrivals and one ``Ledger.release_many`` of their claims on one
connection: the calls a worker's threads make in bench.gate's scenario b. Prints each statement's calls and execution
time per round (µs), the top-level calls first by their total; a statement inside a function is counted inside its
caller's time as well.

Then the server's CPU per task (every backend of the run's database, psutil), and with ``--wal`` the WAL the
measured rounds wrote, per task and by record type (``pg_waldump --stats=record`` of the server's binaries); with
``--perf`` where the backends' CPU goes by kind of work (``perf record -g`` on the backends, Linux ``perf`` on the
PATH), each kind the share of samples whose stack holds one of its PostgreSQL functions: what a statement costs to
start and end, its CHECK constraints, the commit, the rows and index entries themselves.

With ``--sizes 1,3,8`` it then runs the same rounds at each batch size on the same server (as many tasks each as the
main run) and prints, per size, the server's CPU, this client's CPU (the ledger layer and psycopg, one thread) and the
WAL per task, and a least-squares fit of each as ``a + b / size``: what a task costs whatever the batch (``a``) and
what a round of one claim call and one release call costs however many tasks it carries (``b``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from bench.ledger import WAL_DIFF, WAL_LSN, bench_database
from celery_keyed.ledger import Arrival, Ledger, Outcome, ReleaseRequest, Token
from celery_keyed.testing import TestbedError, find_postgres_bindir

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


# Kinds of a backend's work, by the PostgreSQL functions whose frames a perf sample's stack holds (a sample counts in
# every kind it matches: the kinds overlap, e.g. the WAL flush is part of the commit).
PERF_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the ledger's functions (PL/pgSQL), inclusive", ("plpgsql_exec_function",)),
    (
        "a statement's start and end (executor set-up, tear-down, plan cache)",
        ("standard_ExecutorStart", "standard_ExecutorEnd", "standard_ExecutorFinish", "GetCachedPlan", "PortalStart"),
    ),
    ("CHECK constraints (their expressions are set up again at every statement)", ("ExecConstraints",)),
    ("the commit", ("CommitTransactionCommand",)),
    ("— of which the WAL flush (fsync)", ("XLogFlush",)),
    (
        "triggers (the outbox's, the failover guard)",
        ("plpgsql_exec_trigger", "ExecBRInsertTriggers", "AfterTriggerEndQuery", "ExecARInsertTriggers"),
    ),
    ("rows written (heap insert, update, delete)", ("heap_insert", "heap_update", "heap_delete")),
    ("index entries written", ("ExecInsertIndexTuples",)),
    ("index lookups", ("index_getnext_slot", "_bt_first")),
    ("WAL records (insert)", ("XLogInsert",)),
    (
        "the client protocol (read, parse, bind, send)",
        ("pq_getbyte", "socket_flush", "exec_parse_message", "exec_bind_message", "internal_flush", "secure_read"),
    ),
)


def backend_cpu(pids: list[int]) -> float | None:
    """CPU seconds (user + system) the given server processes used so far (psutil, as bench.gate's CPU window); None
    where it cannot tell: a process gone, or not a PostgreSQL process of this machine (a server elsewhere)."""
    import psutil

    total = 0.0
    try:
        for pid in pids:
            proc = psutil.Process(pid)
            if proc.name() != "postgres":
                return None
            times = proc.cpu_times()
            total += times.user + times.system
    except psutil.Error:
        return None
    return total


def wal_by_record(bindir: Path, datadir: str, start: str, end: str) -> list[tuple[str, int, int, int]] | str:
    """``pg_waldump --stats=record`` between two LSNs: (record type, records, bytes without full pages, full-page
    bytes) per type, or why it could not run."""
    waldump = bindir / "pg_waldump"
    if not waldump.is_file():
        return f"no pg_waldump in {bindir}"
    cmd = [str(waldump), "-p", str(Path(datadir) / "pg_wal"), "-s", start, "-e", end, "--stats=record"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = []
    for line in done.stdout.splitlines():
        m = re.match(r"^(\S+/\S+)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)", line)
        if m:
            rows.append((m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return rows or f"pg_waldump gave nothing: {done.stderr.strip()[:200]}"


def perf_kinds(data: Path) -> tuple[int, Counter[str]] | str:
    """The samples of a ``perf record -g`` file, and how many of them fall in each of PERF_KINDS."""
    done = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"perf script failed: {done.stderr.strip()[:200]}"
    total = 0
    counts: Counter[str] = Counter()
    for sample in done.stdout.split("\n\n"):
        lines = sample.strip().splitlines()
        if not lines:
            continue
        total += 1
        frames = {re.sub(r"\+0x.*$", "", parts[1]) for parts in (ln.split() for ln in lines[1:]) if len(parts) > 1}
        for kind, functions in PERF_KINDS:
            if frames.intersection(functions):
                counts[kind] += 1
    return total, counts


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


PIDS = sa.text(
    """
    SELECT pid, datname IS NOT NULL AS backend FROM pg_stat_activity
     WHERE datname = current_database() OR backend_type IN ('walwriter', 'checkpointer', 'background writer')
    """
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.statements", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=1500, help="rounds measured (default 1500)")
    parser.add_argument("--size", type=int, default=3, help="arrivals per claim call and releases per call (3)")
    parser.add_argument("--keys", type=int, default=1000, help="uncontended keys, warmed first (1000)")
    parser.add_argument("--rows", type=int, default=25, help="statements shown (25)")
    parser.add_argument("--wal", action="store_true", help="also the WAL per task by record type (pg_waldump)")
    parser.add_argument("--perf", action="store_true", help="also where the backends' CPU goes (Linux perf)")
    parser.add_argument("--sizes", default="", help="also these batch sizes, e.g. 1,3,8: cost per task and per round")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--sizes takes batch sizes separated by commas, e.g. 1,3,8 (got {args.sizes!r})")
    if any(size < 1 for size in sizes):
        parser.error("--sizes: every batch size is at least 1")
    if args.perf and shutil.which("perf") is None:
        parser.error("--perf needs Linux perf on the PATH")
    wal: list[tuple[str, int, int, int]] | str = "not asked (--wal)"
    profile: tuple[int, Counter[str]] | str = "not asked (--perf)"
    with bench_database(SETTINGS) as (url, server), tempfile.TemporaryDirectory() as tmp:
        engine = sa.create_engine(url, pool_size=2)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
            ledger = Ledger(engine, holder="bench:1:statements")
            keys = [f"k:{i}" for i in range(args.keys)]
            rounds(ledger, keys, "warm", max(1, args.keys // args.size + 100), args.size)
            with engine.begin() as conn:
                conn.execute(sa.text("CHECKPOINT"))  # full-page images after it are counted apart
                conn.execute(sa.text("SELECT pg_stat_statements_reset()"))
                found = conn.execute(PIDS).all()
                datadir = conn.execute(sa.text("SHOW data_directory")).scalar_one()
                start_lsn = conn.execute(WAL_LSN).scalar_one()
            backends = [row.pid for row in found if row.backend]
            background = [row.pid for row in found if not row.backend]
            before = backend_cpu(backends), backend_cpu(background)
            recorder = None
            data = Path(tmp) / "perf.data"
            if args.perf:
                recorder = subprocess.Popen(
                    ["perf", "record", "-g", "-F", "1999", "-o", str(data), "-p", ",".join(map(str, backends))],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)  # perf attaches
            wall = rounds(ledger, keys, "run", args.batches, args.size)
            if recorder is not None:
                recorder.terminate()
                recorder.wait()
            after = backend_cpu(backends), backend_cpu(background)
            with engine.connect() as conn:
                end_lsn = conn.execute(WAL_LSN).scalar_one()
                wal_bytes = conn.execute(WAL_DIFF, {"a": start_lsn, "b": end_lsn}).scalar_one()
                rows = conn.execute(REPORT, {"width": 110, "rows": args.rows}).all()
            if args.wal:
                try:
                    wal = wal_by_record(find_postgres_bindir(), datadir, start_lsn, end_lsn)
                except TestbedError as exc:  # no PostgreSQL binaries here (a server elsewhere)
                    wal = f"no PostgreSQL binaries here: {exc}"
            if args.perf:
                profile = perf_kinds(data)
            swept = [by_size(ledger, engine, keys, size, args.batches * args.size) for size in sizes]
        finally:
            engine.dispose()
    n = args.batches
    tasks = n * args.size
    print(f"{server}; {n} rounds of a claim of {args.size} and their release, {wall / n * 1000:.2f} ms wall per round")
    print("| level | calls per round | µs per round | statement |")
    print("|---|---:|---:|---|")
    for row in rows:
        level = "call" if row.toplevel else "inside"
        query = row.query.replace("|", "\\|")
        print(f"| {level} | {row.calls / n:.2f} | {row.total_exec_time * 1000 / n:.1f} | `{query}` |")
    print()
    cpu = None
    if None not in before and None not in after:
        cpu = (after[0] - before[0]) / tasks * 1e6  # type: ignore[operator]
        bg = (after[1] - before[1]) / tasks * 1e6  # type: ignore[operator]
        print(
            f"server CPU per task: {cpu:.0f} µs in the backends of the run's database, {bg:.0f} µs in the WAL "
            f"writer, checkpointer and background writer (psutil)"
        )
    print(f"WAL per task: {float(wal_bytes) / tasks:.0f} B (pg_current_wal_lsn before and after)")
    if args.wal:
        _print_wal(wal, tasks)
    if args.perf:
        _print_profile(profile, cpu)
    if swept:
        _print_sizes(swept)
    return 0


@dataclass
class SizeRun:
    """One batch size's run (``by_size``): per task, µs of CPU and B of WAL; ms of wall per round."""

    size: int
    server: float | None
    client: float
    wal: float
    wall: float


def by_size(ledger: Ledger, engine: sa.Engine, keys: list[str], size: int, tasks: int) -> SizeRun:
    """Rounds of claim calls of ``size`` arrivals and their releases, about ``tasks`` tasks in all."""
    n = max(1, tasks // size)
    with engine.connect() as conn:
        backends = [row.pid for row in conn.execute(PIDS).all() if row.backend]
        start = conn.execute(WAL_LSN).scalar_one()
    server_before = backend_cpu(backends)
    client_before = time.process_time()
    wall = rounds(ledger, keys, f"size{size}", n, size)
    client = time.process_time() - client_before
    server_after = backend_cpu(backends)
    with engine.connect() as conn:
        wal = float(conn.execute(WAL_DIFF, {"a": start, "b": conn.execute(WAL_LSN).scalar_one()}).scalar_one())
    server = None
    if server_before is not None and server_after is not None:
        server = (server_after - server_before) / (n * size) * 1e6
    return SizeRun(size, server, client / (n * size) * 1e6, wal / (n * size), wall / n * 1000)


def fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares of ``y = a + b / size`` over (size, y); None with fewer than two distinct sizes."""
    xs = [1.0 / size for size, _ in points]
    ys = [y for _, y in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _print_sizes(runs: list[SizeRun]) -> None:
    print()
    print(
        "| tasks per call | server CPU, µs per task | client CPU, µs per task | WAL, B per task | wall, ms per round |"
    )
    print("|---:|---:|---:|---:|---:|")
    for run in runs:
        server = "—" if run.server is None else f"{run.server:.0f}"
        print(f"| {run.size} | {server} | {run.client:.0f} | {run.wal:.0f} | {run.wall:.2f} |")
    columns: list[tuple[str, list[tuple[int, float]]]] = [
        ("server CPU, µs", [(r.size, r.server) for r in runs if r.server is not None]),
        ("client CPU, µs", [(r.size, r.client) for r in runs]),
        ("WAL, B", [(r.size, r.wal) for r in runs]),
    ]
    for label, points in columns:
        line = fit(points)
        if line is not None:
            print(
                f"{label}: {line[0]:.0f} per task + {line[1]:.0f} per round of a claim call and a release call "
                f"(fit of a + b / size)"
            )


def _print_wal(wal: list[tuple[str, int, int, int]] | str, tasks: int) -> None:
    print()
    if isinstance(wal, str):
        print(f"WAL by record type: {wal}")
        return
    print("| WAL record type | records per task | B per task | full-page images, B per task |")
    print("|---|---:|---:|---:|")
    for kind, count, size, fpi in sorted(wal, key=lambda r: -r[2]):
        print(f"| {kind} | {count / tasks:.2f} | {size / tasks:.0f} | {fpi / tasks:.0f} |")
    print(
        f"| total | {sum(r[1] for r in wal) / tasks:.2f} | {sum(r[2] for r in wal) / tasks:.0f} | "
        f"{sum(r[3] for r in wal) / tasks:.0f} |"
    )


def _print_profile(profile: tuple[int, Counter[str]] | str, cpu: float | None) -> None:
    print()
    if isinstance(profile, str):
        print(f"where the backends' CPU goes: {profile}")
        return
    total, counts = profile
    print(f"| where the backends' CPU goes ({total} perf samples) | share of samples | µs per task |")
    print("|---|---:|---:|")
    for kind, _functions in PERF_KINDS:
        share = counts[kind] / total if total else 0.0
        per_task = f"{share * cpu:.0f}" if cpu is not None else "—"
        print(f"| {kind} | {share * 100:.1f} % | {per_task} |")


if __name__ == "__main__":
    raise SystemExit(main())
