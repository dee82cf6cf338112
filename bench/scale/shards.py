"""bench.scale's third measure: the hot gate with 8 shards against 1 (bench.ledger's clients)."""

from __future__ import annotations

import statistics

import sqlalchemy as sa

from bench.scale.ledgers import Server, load
from celery_keyed.ledger import Ledger

# -- 3. hot gate shards -----------------------------------------------------------------------------------------


def shards(
    srv: Server, *, rounds: int, seconds: float, warmup: float, clients: int
) -> tuple[list[str], tuple[str, str]]:
    from bench import ledger as bl

    load0 = load()
    url = srv.database("shards")
    engine = sa.create_engine(url, pool_size=1, max_overflow=0)
    Ledger(engine).configure(bl.NAMES)
    measures = {"gate1": bl.Measure(), "gate8": bl.Measure()}
    pool = bl.Clients(url, clients)
    try:
        for r in range(rounds):
            order = ("gate1", "gate8") if r % 2 == 0 else ("gate8", "gate1")
            for name in order:
                rate, latencies, _, _ = pool.run(engine, name, warmup, seconds)
                measures[name].rates.append(rate)
                measures[name].latencies += latencies
                measures[name].wal.append(0.0)
                print(f"    round {r + 1}: {bl.BY_NAME[name].label:<38} {rate:7.0f} cycles/s", flush=True)
    finally:
        pool.close()
        engine.dispose()
    g1, g8 = measures["gate1"], measures["gate8"]
    per_round = [a / b for a, b in zip(g8.rates, g1.rates, strict=True)]
    rows = ["| gate | cycles/s median (min-max) | p50 claim ms | p99 claim ms |", "|---|---:|---:|---:|"]
    for name, m in measures.items():
        rows.append(f"| {bl.BY_NAME[name].label} | {m.rate:.0f} ({min(m.rates):.0f}-{max(m.rates):.0f}) "
                    f"| {m.percentile(0.5):.2f} | {m.percentile(0.99):.2f} |")
    rows.append("")
    rows.append(f"8 shards vs 1 shard: {statistics.median(per_round):.2f}x throughput, median of {rounds} interleaved "
                f"rounds (spread {min(per_round):.2f}-{max(per_round):.2f}; per round "
                f"{', '.join(f'{x:.2f}' for x in per_round)}; target ≥ 1.25x); p99 claim "
                f"{g8.percentile(0.99):.2f} ms vs {g1.percentile(0.99):.2f} ms; {clients} client processes, "
                f"K = {bl.GATE_LIMIT}, {warmup:g} s warm-up + {seconds:g} s per run")
    return rows, (load0, load())
