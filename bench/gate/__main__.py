"""``python -m bench.gate``: the scenarios of ``bench.gate`` (its docstring) in one run, and their report."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import bench.gate as gate_package
from bench.gate.harness import (
    Bench,
    Contended,
    Pairs,
    contended,
    ratio_pairs,
    ratio_rounds,
    servers,
    warm_keys,
)
from bench.gate.report import cpu_rows, last_key_parts, partial_report, pct, report, variant_report
from bench.gate.worker_app import KEYS, READY_LIST


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gate", description=(gate_package.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a short run: fewer pairs, fewer tasks")
    parser.add_argument("--tasks", type=int, help="tasks per throughput run (a, b); default 2000, quick 500")
    parser.add_argument("--pairs", type=int, help="pairs of a, each in turn first (default 6, quick 2)")
    parser.add_argument("--keyed-pairs", type=int, help="rounds of b, each variant in turn first (default 4, quick 1)")
    parser.add_argument("--handoff-tasks", type=int, help="tasks of c per run (default 200, quick 100)")
    parser.add_argument("--repeats", type=int, help="runs of c and of d (default 2 and 3, quick 1)")
    parser.add_argument("--without-ledger", action="store_true",
                        help="also b with claims and releases answered in the worker, no database (no bound kept), "
                             "through its threads (b0) and on its loop (b00)")
    parser.add_argument("--loop-releases", action="store_true",
                        help="also b with the uncontended releases made from the consumer loop without blocking it "
                             "(a measurement of that design, taking turns with b)")
    parser.add_argument("--loop-admission", action="store_true",
                        help="also run b's pairs with admission on the consumer loop (keyed_admission_batch = 0)")
    parser.add_argument("--only", default="abcd", metavar="SCENARIOS",
                        help="run only these scenarios, e.g. b or cd (default abcd: all, with the full report)")
    parser.add_argument("--control", action="store_true",
                        help="also run a's pairs as A then A again: the noise floor of a ratio on this machine")
    args = parser.parse_args(argv)
    only = set(args.only)
    if not only or only - set("abcd"):
        parser.error("--only takes letters of abcd")
    quick = args.quick
    n = args.tasks or (500 if quick else 2000)
    pairs = args.pairs or (2 if quick else 6)
    keyed_pairs = args.keyed_pairs or (1 if quick else 4)
    handoff_tasks = args.handoff_tasks or (100 if quick else 200)
    c_runs = args.repeats or (1 if quick else 2)
    d_runs = args.repeats or (1 if quick else 3)

    import redis

    started = time.monotonic()
    with servers() as (database_url, broker_url, described), tempfile.TemporaryDirectory(
        prefix="bench-gate-"
    ) as logs:
        client = redis.Redis.from_url(broker_url)
        bench = Bench(broker_url, database_url, client, Path(logs))
        load = os.getloadavg()
        print(f"servers: {described}; {os.cpu_count()} CPUs, load average {load[0]:.1f} at start", flush=True)

        a_pairs, b_pairs = Pairs(), Pairs()
        c_results: list[Contended] = []
        d_results: list[Contended] = []
        control: list[float] = []
        loop_ratios: list[float] = []
        free_pairs = loop_free_pairs = loop_release_pairs = loop_ledger_pairs = Pairs()
        if "a" in only:
            print(f"\na. unkeyed tasks, A plain vs B celery-keyed installed: {pairs} pairs of {n} tasks, c=2",
                  flush=True)
            a_pairs = ratio_pairs(bench, pairs, "noop", n, False, "a")
        if "a" in only and args.control:
            print(f"\na'. control: A plain and A plain again, each in turn first, {pairs} pairs of {n} tasks, c=2",
                  flush=True)
            control = ratio_pairs(bench, pairs, "noop", n, False, "a'", second="plain").ratios

        if "b" in only:
            print(f"\nb. keyed tasks on {KEYS} uncontended keys vs the same task plain: {keyed_pairs} pairs of {n} "
                  f"tasks, c=2 (warming {KEYS} keys first)", flush=True)
            warm_keys(database_url)
            if args.loop_releases:
                b_pairs, loop_release_pairs, loop_ledger_pairs = ratio_rounds(
                    bench, keyed_pairs, "keyed_noop", n, True, ["b", "b-loop", "b-loop2"],
                    ["keyed", "keyed-loop-releases", "keyed-loop-ledger"],
                )
            else:
                b_pairs = ratio_pairs(bench, keyed_pairs, "keyed_noop", n, True, "b")
        if "b" in only and args.loop_admission:
            print(f"\nb'. the same, admission on the consumer loop (keyed_admission_batch = 0): {keyed_pairs} pairs",
                  flush=True)
            loop_ratios = ratio_pairs(bench, keyed_pairs, "keyed_noop", n, True, "b'", second="keyed-loop").ratios
        if "b" in only and args.without_ledger:
            print(f"\nb0. the same, claims and releases answered in the worker without the ledger (no bound kept),"
                  f" and b00, those answers given on the consumer loop (no thread between): {keyed_pairs} rounds",
                  flush=True)
            free_pairs, loop_free_pairs = ratio_rounds(
                bench, keyed_pairs, "keyed_noop", n, True, ["b0", "b00"], ["keyed-free", "keyed-free-loop"]
            )

        if "c" in only:
            print(f"\nc. handoff, one key, K = 1: {c_runs} run(s) of {handoff_tasks} tasks of 5 ms, 2 workers c=2",
                  flush=True)
        for r in range(c_runs if "c" in only else 0):
            res = contended(bench, [f"h{r}:{uuid.uuid4().hex[:6]}"], handoff_tasks, 0.005, 2, 2)
            c_results.append(res)
            print(f"  run {r + 1}: p50 {pct(res.handoffs, 0.5) * 1000:.2f} ms, p99 "
                  f"{pct(res.handoffs, 0.99) * 1000:.2f} ms, max {max(res.handoffs) * 1000:.1f} ms; after the "
                  f"ledger had every arrival (+{res.recorded_after:.2f} s): p50 {pct(res.steady, 0.5) * 1000:.2f} "
                  f"ms, p99 {pct(res.steady, 0.99) * 1000:.2f} ms ({len(res.steady)}); "
                  f"{res.per_task:.3f} messages/task, overlaps {res.overlaps}", flush=True)

        if "d" in only:
            print(f"\nd. contended workload: {d_runs} run(s) of 5 keys x 40 tasks of 50 ms, K = 1, 2 workers c=4",
                  flush=True)
        for r in range(d_runs if "d" in only else 0):
            tag = uuid.uuid4().hex[:6]
            res = contended(bench, [f"m{i}:{tag}" for i in range(5)], 40, 0.05, 2, 4)
            d_results.append(res)
            print(f"  run {r + 1}: makespan {res.makespan:.3f} s = {res.makespan / 2.0:.3f} x ideal; handoff p50 "
                  f"{pct(res.handoffs, 0.5) * 1000:.2f} ms, p99 {pct(res.handoffs, 0.99) * 1000:.2f} ms; "
                  f"{res.per_task:.3f} messages/task; overlaps {res.overlaps}; ledger had every arrival at "
                  f"+{res.recorded_after:.2f} s; {last_key_parts(res)}", flush=True)
        load_end = os.getloadavg()
        if bench._ledger is not None:
            bench._ledger.dispose()
        client.delete(READY_LIST)
        for app in bench.producers.values():
            app.close()

    print()
    if only == set("abcd"):
        print(report(a_pairs, b_pairs, c_results, d_results, control))
    else:
        print(partial_report(a_pairs, b_pairs, c_results, d_results))
    if loop_ratios:
        print(f"b'. keyed with admission on the loop / plain: median {statistics.median(loop_ratios):.3f} "
              f"(admission thread: {statistics.median(b_pairs.ratios):.3f})")
    if free_pairs.ratios:
        print(f"b0. keyed without ledger calls / plain: median {statistics.median(free_pairs.ratios):.3f}, range "
              f"{min(free_pairs.ratios):.3f}-{max(free_pairs.ratios):.3f} (with the ledger: "
              f"{statistics.median(b_pairs.ratios):.3f})")
        print("\n".join(row.replace("| b. ", "| b0. ") for row in cpu_rows(free_pairs)))
    for label, what, pairs_of, base_label, base in (
        ("b-loop", "keyed, releases from the loop", loop_release_pairs, "b", b_pairs),
        ("b-loop2", "keyed, claims ahead and releases from the loop", loop_ledger_pairs, "b", b_pairs),
        ("b00", "keyed without ledger calls, on the loop", loop_free_pairs, "b0", free_pairs),
    ):
        if pairs_of.ratios:
            print(variant_report(label, what, pairs_of, base_label, base))
    print(f"\nload average {load[0]:.1f} at start, {load_end[0]:.1f} at end; total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
