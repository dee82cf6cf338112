"""``python -m bench.scale``: the three measures (the package's docstring) in one run, and their tables."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import bench.scale as scale_package
from bench.procs import run_locked
from bench.scale.ledgers import SMOKE, load, server
from bench.scale.memory import memory, memory_table
from bench.scale.promotion import promotion, promotion_table, uses_index
from bench.scale.shards import shards


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale",
                                     description=(scale_package.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer cycles, rounds and pairs (same ledger sizes)")
    parser.add_argument("--only", default="promotion,memory,shards", help="sections to run (comma-separated)")
    parser.add_argument("--parked", type=int, default=1_000_000, help="parked attempts of the large ledger")
    parser.add_argument("--small", type=int, default=100, help="parked attempts of the small ledger")
    parser.add_argument("--spread-keys", type=int, default=10_000, help="filler keys the parked rows spread over")
    parser.add_argument("--cycles", type=int, help="measured promotions per line (default 300, quick 100)")
    parser.add_argument("--memory-parked", type=int, default=100_000, help="parked attempts for the worker")
    parser.add_argument("--memory-pairs", type=int, help="empty/parked worker pairs (default 2, quick 1)")
    parser.add_argument("--sweep-seconds", type=float, help="seconds a worker sweeps before RSS (default 30, quick 10)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the shards comparison (default 6, quick 5)")
    parser.add_argument("--seconds", type=float, help="measured seconds per shards run (default 5, quick 2)")
    parser.add_argument("--no-explain", action="store_true", help="skip the EXPLAIN output")
    parser.add_argument("--lock-wait", type=float, help="seconds to wait for the benchmark lock (exit 75 after)")
    parser.add_argument("--no-lock", action="store_true", help="do not take the benchmark lock")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse(raw)
    if not args.no_lock:
        run_locked("bench.scale", raw, args.lock_wait)
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - {"promotion", "memory", "shards"}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}")
    quick = args.quick
    cycles = args.cycles or (100 if quick else 300)
    started, load_start = time.monotonic(), load()
    print(f"bench.scale: {SMOKE} unless run alone on a quiet machine. {os.cpu_count()} CPUs; "
          f"load average before: {load_start}", flush=True)
    out: list[str] = []
    with server() as (srv, described):
        print(f"server: {described}", flush=True)
        if "promotion" in sections:
            print("1. promotion latency", flush=True)
            res = promotion(srv, parked=args.parked, small=args.small, cycles=cycles, warmup=max(5, cycles // 10),
                            spread_keys=args.spread_keys, deep_share=0.1, explain_plans=not args.no_explain)
            out += [f"### Promotion latency, {args.parked:,} parked vs {args.small:,} ({SMOKE}; load "
                    f"{res.load[0]} → {res.load[1]})", "", *promotion_table(res), ""]
            if res.plans:
                out += ["Index used at the large ledger (EXPLAIN ANALYZE, BUFFERS):"]
                heads = [i for i, line in enumerate(res.plans) if line.startswith("-- ")] + [len(res.plans)]
                for a, b in itertools.pairwise(heads):
                    out.append(f"  {res.plans[a][3:]}: {uses_index(res.plans[a + 1:b])}")
                out += ["", "EXPLAIN (ANALYZE, BUFFERS) at the large ledger:", "```", *res.plans, "```", ""]
        if "memory" in sections:
            print("2. worker memory", flush=True)
            sweep = args.sweep_seconds or (10.0 if quick else 30.0)
            runs, loads = memory(srv, parked=args.memory_parked, pairs=args.memory_pairs or (1 if quick else 2),
                                 sweep_seconds=sweep, spread_keys=max(1, min(1_000, args.memory_parked // 100)),
                                 real_parks=5)
            out += [f"### Worker memory, {args.memory_parked:,} parked vs none ({SMOKE}; load "
                    f"{loads[0]} → {loads[1]})", "", *memory_table(runs, sweep), ""]
        if "shards" in sections:
            print("3. hot gate, 8 shards vs 1", flush=True)
            rows, loads = shards(srv, rounds=args.rounds or (5 if quick else 6),
                                 seconds=args.seconds or (2.0 if quick else 5.0), warmup=1.0 if not quick else 0.5,
                                 clients=4)
            out += [f"### Hot gate, 8 shards vs 1 ({SMOKE}; load {loads[0]} → {loads[1]})", "", *rows, ""]
    print()
    print("\n".join(out))
    print(f"load average before {load_start}, after {load()}; total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
