"""``python -m bench.peers``: every system on every workload in one run (the package's docstring), and the report."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import bench.peers as peers_package
from bench.peers.harness import ROOT, Bench, Proc, cleanup, freeze, importable, peers_venv, servers
from bench.peers.plan import BY_NAME, ORDER, SLOW_TIMEOUT, WORKLOADS, Result, System, Workload, pct, task_list
from bench.peers.report import DOCS, docs_section, machine, report, versions, write_docs
from bench.procs import run_locked

# -- main ---------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peers",
                                     description=(peers_package.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 run of a subset: W1, W2, W6 at 1,000 tasks (the slow defaults: W1)")
    parser.add_argument("--repeats", type=int, help="runs of each system x workload (default 3, quick 1)")
    parser.add_argument("--systems", help="comma-separated, of: " + ", ".join(BY_NAME))
    parser.add_argument("--workloads", help="comma-separated, of: " + ", ".join(WORKLOADS))
    parser.add_argument("--all-workloads", action="store_true", help="also run the slow defaults on every workload")
    parser.add_argument("--scale", type=float, default=1.0, help="tasks per key x this (a smoke run: 0.1)")
    parser.add_argument("--seconds", type=float, help="task duration instead of 50 ms (not W6's trivial tasks)")
    parser.add_argument("--timeout", type=float,
                        help="stop a run after max(this, 8 x ideal) s and report it unfinished (default 60, quick 30)")
    parser.add_argument("--slow-timeout", type=float,
                        help=f"stop a run of the slow defaults after this many seconds (default {SLOW_TIMEOUT:.0f}: "
                             "waits of seconds between tries, which the table reports as '> N' at the timeout)")
    parser.add_argument("--order", choices=["round-robin", "key-major"], default="round-robin",
                        help="publish order of W1-W5 (default round-robin, as bench.gate)")
    parser.add_argument("--lock-wait", type=float,
                        help="give up after this many seconds waiting for the benchmark lock (exit 75)")
    parser.add_argument("--no-install", action="store_true", help="never create .bench-venv: skip the peers")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--smoke", action="store_true",
                        help="label the figures 'smoke, machine shared: not evidence' (implied by --quick, "
                             "by --scale < 1 and by a load average >= 1 at the start)")
    parser.add_argument("--working-tree", action="store_true",
                        help="run celery_keyed/ from the working tree (default: a frozen copy of HEAD)")
    parser.add_argument("--no-lock", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse(raw)
    if not args.no_lock:
        run_locked("bench.peers", raw, args.lock_wait)
    repeats = args.repeats or (1 if args.quick else 3)
    timeout = args.timeout or (30.0 if args.quick else 60.0)
    slow_timeout = args.slow_timeout or SLOW_TIMEOUT
    ORDER[0] = args.order
    names = args.systems.split(",") if args.systems else list(BY_NAME)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown systems: {unknown}; known: {list(BY_NAME)}")
    systems = [BY_NAME[n] for n in names]
    wl_names = args.workloads.split(",") if args.workloads else (["W1", "W2", "W6"] if args.quick else
                                                                  list(WORKLOADS))
    scale = args.scale
    workloads = []
    for n in wl_names:
        wl = WORKLOADS[n]
        if args.quick and n == "W6" and scale == 1:
            wl = Workload("W6", 1000, 1, 1, 0.0)
        workloads.append(wl.scaled(scale, args.seconds))

    skipped: dict[str, str] = {}
    if any(s.venv == "peers" for s in systems):
        why = peers_venv(install=not args.no_install)
        for s in systems:
            if s.venv == "peers":
                reason = f"not installed: {why}" if why else importable(s)
                if reason:
                    skipped[s.name] = reason
                    print(f"{s.name}: {reason}", flush=True)
    runnable = [s for s in systems if s.name not in skipped]
    families = {("keyed" if s.family == "celery" else s.family) for s in runnable}

    import redis

    started = time.monotonic()
    started_at = time.strftime("%Y-%m-%d %H:%M %Z")
    load_start = os.getloadavg()
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        logs = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-peers-"))
        if not args.working_tree:
            frozen = Path(logs) / "frozen"
            frozen.mkdir()
            print(f"celery-keyed: a frozen copy of celery_keyed/ at {freeze(frozen)} (git archive HEAD)", flush=True)
        urls, broker_url, observer_url, described = stack.enter_context(servers(families))
        bench = Bench(urls, broker_url, observer_url, redis.Redis.from_url(observer_url),
                      redis.Redis.from_url(broker_url), Path(logs))
        print(f"servers: {described}; {machine()}; load average {load_start[0]:.2f} at start", flush=True)
        for repeat in range(repeats):
            order = runnable[repeat % len(runnable):] + runnable[:repeat % len(runnable)] if runnable else []
            if repeat % 2:
                order.reverse()
            for system in order:
                slow = system.slow and not args.all_workloads  # W1 and W3 in the first repeat only
                mine = [wl for wl in workloads if not (system.k1_only and wl.limit > 1)
                        and not (slow and (repeat > 0 or wl.name not in ("W1", "W3")))]
                if not mine:
                    continue
                print(f"\nrepeat {repeat + 1}/{repeats}: {system.label}", flush=True)
                results += run_system(bench, system, mine, repeat, slow_timeout if system.slow else timeout,
                                      cap=system.slow)
        load_end = os.getloadavg()

    total = time.monotonic() - started
    smoke = args.smoke or args.quick or scale < 1 or load_start[0] >= 1.0
    table = report(results, workloads, systems, skipped)
    head = [f"Run of {started_at}: `python -m bench.peers {' '.join(raw)}`".rstrip(),
            f"({repeats} repeat(s), {total:.0f} s). Machine: {machine()}. Servers: {described}. {versions()}.",
            f"Load average (1 / 5 / 15 min): {' / '.join(f'{x:.2f}' for x in load_start)} before, "
            f"{' / '.join(f'{x:.2f}' for x in load_end)} after."]
    if smoke:
        head.insert(0, "**Smoke, machine shared: not evidence.** These figures show the harness runs; do not "
                       "read them as results.\n")
    print("\n" + "\n".join(head) + "\n" + table)
    if args.write_docs:
        write_docs(docs_section("\n".join(head) + "\n" + table))
        print(f"\nwrote {DOCS.relative_to(ROOT)}")
    return 0


def run_system(bench: Bench, system: System, workloads: list[Workload], repeat: int,
               timeout: float, cap: bool = False) -> list[Result]:
    """``cap``: ``timeout`` is the whole limit of a run (the slow defaults), not its floor."""
    results: list[Result] = []
    per_workload = system.family == "pgqueuer"  # its key set is fixed when its workers start

    def one(wl: Workload, queue: str, procs: list[Proc], tag: str | None = None) -> None:
        limit = max(timeout, 8 * wl.ideal) if not wl.throughput else max(timeout, wl.tasks / 20)
        if cap:
            limit = timeout
        try:
            res = bench.run(system, wl, queue, procs, repeat, limit, tag)
        except Exception as exc:  # one system's failure must not lose the others' figures
            res = Result(system.name, wl.name, repeat, wl.tasks, error=str(exc).splitlines()[0] if str(exc) else
                         type(exc).__name__)
            print(f"  {wl.name}: ERROR {exc}", flush=True)
        else:
            what = (f"{res.rate:.0f} tasks/s" if wl.throughput else
                    f"{res.ratio:.2f} x ideal, handoff p50 {pct(res.handoffs, 0.5) * 1000:.0f} ms p99 "
                    f"{pct(res.handoffs, 0.99) * 1000:.0f} ms")
            print(f"  {wl.name}: {what}; peak {res.peak} (K {wl.limit}); {res.messages:.2f} msgs/task; retries "
                  f"{res.retries}, refused {res.refused}, failed {res.failed}, lost {res.lost}"
                  f"{'' if res.finished else f', UNFINISHED after {res.waited:.0f} s ({res.unfinished} left)'}; "
                  f"load {res.load[0]:.2f} -> {res.load[1]:.2f}", flush=True)
        results.append(res)

    try:
        if per_workload:  # PgQueuer: workers started for the run's own keys (its key set is fixed at start)
            for wl in workloads:
                queue, tag = bench.tag(), bench.tag()
                keys = {key: wl.limit for key, *_ in task_list(wl, tag)}
                with bench.workers(system, queue, keys) as procs:
                    one(wl, queue, procs, tag)
                cleanup(bench, system)
        else:
            queue = bench.tag()
            with bench.workers(system, queue) as procs:
                for wl in workloads:
                    one(wl, queue, procs)
            cleanup(bench, system)
    except Exception as exc:
        print(f"  {system.name}: ERROR {exc}", flush=True)
        results += [Result(system.name, wl.name, repeat, wl.tasks, error=str(exc).splitlines()[0])
                    for wl in workloads if not any(r.workload == wl.name for r in results)]
        with contextlib.suppress(Exception):
            cleanup(bench, system)
    return results


if __name__ == "__main__":
    sys.exit(main())
