"""bench.scale's first measure: promotion latency with 1,000,000 parked attempts against 100, and the plans of
the promotion's and the sweep's statements on the large ledger."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from bench.scale.ledgers import MEAS_NAME, SHALLOW, Server, check_books, fill, load, pct, spread_key
from celery_keyed.ledger import Arrival, Ledger, Outcome, Token, Verdict

# -- 1. promotion latency ----------------------------------------------------------------------------------------


class Line:
    """One measured key (K = 1): a running claim of the benchmark and ``behind`` attempts parked behind it."""

    def __init__(self, label: str, ledger: Ledger, key: str) -> None:
        self.label, self.ledger, self.key = label, ledger, key
        self.prefix = f"{key}-{uuid.uuid4().hex[:6]}-"
        self.seq = 0
        self.latencies: list[float] = []
        self.token: Token | None = None
        self.fence = 0

    def arrive(self) -> Verdict:
        self.seq += 1
        task_id = f"{self.prefix}{self.seq}"
        admission = self.ledger.admit(Arrival(task_id=task_id, key=self.key, task_name="bench.hold", queue="celery",
                                              message={"task": "bench.hold", "id": task_id, "args": [self.seq]}))
        if admission.verdict is Verdict.ADMITTED:
            self.token, self.fence = Token(task_id, 0), int(admission.fence or 0)
        return admission.verdict

    def start(self, behind: int) -> None:
        if self.arrive() is not Verdict.ADMITTED:
            raise RuntimeError(f"{self.key}: the first arrival did not get the slot")
        for _ in range(behind):
            if self.arrive() is not Verdict.PARKED:
                raise RuntimeError(f"{self.key}: an arrival behind the running claim did not park")

    def cycle(self, record: bool = True) -> None:
        """Release the running claim (timed: the release and the promotion it makes), bind the promoted
        attempt, park one more at the tail."""
        assert self.token is not None
        started = time.perf_counter()
        report = self.ledger.release(self.token, self.fence, Outcome.COMPLETED, contended=True)
        elapsed = time.perf_counter() - started
        if not report.released or len(report.promotions) != 1 or report.promotions[0].nonce is None:
            raise RuntimeError(f"{self.key}: release promoted {report.promotions!r}")
        promoted = report.promotions[0]
        token = Token(promoted.task_id, promoted.attempt)
        fence = self.ledger.bind(token, promoted.nonce)  # type: ignore[arg-type]
        if fence is None:
            raise RuntimeError(f"{self.key}: the promotion of {token} did not bind")
        self.token, self.fence = token, fence
        if self.arrive() is not Verdict.PARKED:
            raise RuntimeError(f"{self.key}: the tail arrival did not park")
        if record:
            self.latencies.append(elapsed)


#: The statements a release's promotion sends (promote.promote_waiters), and the sweep's scans of the waiting room.
def _explained() -> list[tuple[str, Any, dict[str, Any]]]:
    from celery_keyed.ledger import keys, waiting

    return [
        ("promotion: waiting.WAITING_NEXT_FOR_KEY", waiting.WAITING_NEXT_FOR_KEY, {"limit": 4}),
        ("promotion: waiting.WAITING_CLEAR_DUE_FOR_KEY", waiting.WAITING_CLEAR_DUE_FOR_KEY, {"name": MEAS_NAME}),
        ("release: keys.KEYS_GET_WAITING", keys.KEYS_GET_WAITING, {}),
        ("claim fast path: fast_paths.CLAIM_NEW's NOT EXISTS (waiting.WAITING_PROMOTABLE_EXISTS)",
         waiting.WAITING_PROMOTABLE_EXISTS, {}),
        ("sweep: waiting.WAITING_KEYS_PROMOTABLE", waiting.WAITING_KEYS_PROMOTABLE, {"limit": 10_000}),
        ("sweep: waiting.WAITING_ORPHAN_SHADOWS", waiting.WAITING_ORPHAN_SHADOWS, {"batch": 500}),
        ("sweep: waiting.WAITING_MULTI_PROMOTABLE", waiting.WAITING_MULTI_PROMOTABLE, {"limit": 1_000}),
        ("sweep: waiting.WAITING_CLEAR_DUE", waiting.WAITING_CLEAR_DUE, {"batch": 500}),
        ("sweep: waiting.WAITING_DELETE_EXPIRED", waiting.WAITING_DELETE_EXPIRED, {"batch": 1}),
    ]


def _generic(statement: str, params: dict[str, Any]) -> tuple[str, str, list[Any]]:
    """PREPARE / EXECUTE text for ``statement`` (named binds → $n), to EXPLAIN its generic plan too: after five
    executions psycopg prepares a statement, and PostgreSQL may then use a plan made without the values."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in order:
            order.append(match.group(1))
        return f"${order.index(match.group(1)) + 1}"

    text = re.sub(r"(?<!:):([a-z_]+)", number, statement)
    types = {"now": "timestamptz", "limit": "integer", "batch": "integer"}
    decl = ", ".join(types.get(name, "text") for name in order)
    return text, decl, [params[name] for name in order]


def explain(url: str, keys: list[str]) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the promotion's statements for each key, and of the sweep's scans; each in a
    transaction that is rolled back (the custom plan, then the generic one for the key-bound statements)."""
    engine = sa.create_engine(url, pool_size=1, max_overflow=0)
    out: list[str] = []
    try:
        for label, clause, extra in _explained():
            bound = ":key" in clause.text
            for key in keys if bound else [None]:
                params = {"now": None, "key": key, **extra}
                for mode in ("custom", "generic") if bound else ("custom",):
                    with engine.connect() as conn:
                        tx = conn.begin()
                        try:
                            if mode == "custom":
                                rows = conn.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS) " + clause.text), params)
                            else:
                                text, decl, values = _generic(clause.text, params)
                                conn.execute(sa.text("SET LOCAL plan_cache_mode = force_generic_plan"))
                                conn.exec_driver_sql(f"PREPARE bench_scale_p ({decl}) AS {text}")
                                args = ", ".join("NULL" if v is None else f"'{v}'" for v in values)
                                rows = conn.exec_driver_sql(
                                    f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE bench_scale_p ({args})")
                            plan = [r[0] for r in rows]
                        finally:
                            tx.rollback()
                            if mode == "generic":
                                conn.exec_driver_sql("DEALLOCATE ALL")
                    where = f" key={key}" if key else ""
                    out.append(f"-- {label}{where} ({mode} plan)")
                    out += [f"   {line}" for line in plan]
    finally:
        engine.dispose()
    return out


def uses_index(plan_lines: list[str]) -> str:
    scans = [m.group(0) for line in plan_lines for m in re.finditer(r"(Index Only Scan|Index Scan|Bitmap Index Scan|"
                                                                     r"Seq Scan)( using \w+)?( on \w+)?", line)]
    return "; ".join(dict.fromkeys(scans)) or "?"


@dataclass
class PromotionResult:
    lines: list[Line]
    fills: dict[str, float]
    books: dict[str, tuple[int, int, list[str]]]
    plans: list[str]
    load: tuple[str, str]
    sweeps: dict[str, float] = field(default_factory=dict)


def promotion(srv: Server, *, parked: int, small: int, cycles: int, warmup: int, spread_keys: int,
              deep_share: float, explain_plans: bool = True) -> PromotionResult:
    load0 = load()
    urls = {"small": srv.database("small"), "large": srv.database("large")}
    engines = {n: sa.create_engine(u, pool_size=2, max_overflow=0) for n, u in urls.items()}
    try:
        ledgers = {n: Ledger(e, lease=3600) for n, e in engines.items()}
        lines = [Line(f"{small:,} parked, meas:0 ({SHALLOW} behind it)", ledgers["small"], f"{MEAS_NAME}:0"),
                 Line(f"{parked:,} parked, meas:0 ({SHALLOW} behind it)", ledgers["large"], f"{MEAS_NAME}:0")]
        deep = max(1, int(parked * deep_share))
        deep_line = Line(f"{parked:,} parked, meas:deep ({deep:,} behind it)", ledgers["large"], f"{MEAS_NAME}:deep")
        lines.append(deep_line)
        for line in lines:
            line.start(SHALLOW if line is not deep_line else 0)
        fills = {}
        print(f"  filling: small {small:,}, large {parked:,} parked attempts ...", flush=True)
        fills["small"] = fill(engines["small"], [(spread_key(max(1, min(spread_keys, small // 10))),
                                                 small - SHALLOW)])
        fills["large"] = fill(engines["large"], [(f"'{MEAS_NAME}:deep'", deep),
                                                 (spread_key(spread_keys), parked - SHALLOW - deep)])
        print(f"  filled in {fills['small']:.1f} s / {fills['large']:.1f} s; checking the books ...", flush=True)
        books = {n: check_books(e) for n, e in engines.items()}
        for n, (rows, counted, drift) in books.items():
            if drift or rows != counted:
                raise RuntimeError(f"{n}: the filled ledger's books do not balance: {rows} rows, "
                                   f"waiting {counted}, drift {drift[:5]}")
        for _ in range(warmup):
            for line in lines:
                line.cycle(record=False)
        for _ in range(cycles):
            for line in lines:
                line.cycle()
        sweeps = {}
        for n, ledger in ledgers.items():  # one sweep, as every worker runs each keyed_sweep_interval (D2)
            t0 = time.perf_counter()
            ledger.sweep()
            sweeps[n] = time.perf_counter() - t0
        plans = explain(urls["large"], [f"{MEAS_NAME}:0", f"{MEAS_NAME}:deep"]) if explain_plans else []
        after = {n: check_books(e) for n, e in engines.items()}
        for n, (rows, counted, drift) in after.items():
            if drift or rows != counted:
                raise RuntimeError(f"{n}: the books do not balance after the cycles: {drift[:5]}")
        return PromotionResult(lines, fills, books, plans, (load0, load()), sweeps)
    finally:
        for e in engines.values():
            e.dispose()


def promotion_table(result: PromotionResult) -> list[str]:
    base = result.lines[0]
    b50, b99 = pct(base.latencies, 0.5), pct(base.latencies, 0.99)
    rows = ["| line | cycles | p50 ms | p99 ms | p50 vs the small ledger | p99 vs the small ledger |",
            "|---|---:|---:|---:|---:|---:|"]
    for line in result.lines:
        p50, p99 = pct(line.latencies, 0.5), pct(line.latencies, 0.99)
        rows.append(f"| {line.label} | {len(line.latencies)} | {p50 * 1000:.2f} | {p99 * 1000:.2f} "
                    f"| {p50 / b50:.2f}x | {p99 / b99:.2f}x |")
    rows.append("")
    rows.append("target: promotion latency with 1,000,000 parked vs 100 ≤ 2x (release → promotion, one "
                "transaction; lines cycled in turn)")
    rows.append(f"filled in {result.fills['small']:.1f} s / {result.fills['large']:.1f} s; books after filling "
                f"(parked rows = sum of keyed_keys.waiting, reconcile drift): "
                + "; ".join(f"{n} {r:,} = {c:,}, drift {len(d)}" for n, (r, c, d) in result.books.items()))
    if result.sweeps:
        small, large = result.sweeps["small"], result.sweeps["large"]
        rows.append(f"one Ledger.sweep() (what every worker runs each keyed_sweep_interval): {small * 1000:.0f} ms on "
                    f"the small ledger, {large * 1000:.0f} ms on the large one ({large / small:.0f}x; not a "
                    f"DESIGN §8 target: the sweep's scans are EXPLAINed below)")
    return rows
