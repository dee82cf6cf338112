"""bench.peers' report: the machine and the versions, the table of every system on every workload, and the section
of docs/benchmarks.md it writes (between its markers)."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from bench.peers.harness import FROZEN, PEERS_VENV, ROOT
from bench.peers.plan import Result, System, Workload, pct

DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench.peers:begin -->", "<!-- bench.peers:end -->"


# -- the machine --------------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.0f} GiB"
    return f"{os.cpu_count()} CPUs ({cpu}), {mem} RAM, {platform.system()} {platform.release()}"


def versions() -> str:
    script = ("import importlib.metadata as m\nfor p in ('celery','kombu','celery-once','dramatiq','procrastinate',"
              "'pgqueuer','redis','psycopg'):\n try: print(p, m.version(p))\n except Exception: pass")
    found: dict[str, str] = {}
    for py in (sys.executable, str(PEERS_VENV / "bin" / "python")):
        if Path(py).exists():
            out = subprocess.run([py, "-c", script], capture_output=True, text=True).stdout
            for line in out.splitlines():
                name, _, version = line.partition(" ")
                found.setdefault(name, version)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "celery_keyed"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    where = (f"a frozen copy of celery_keyed/ at {commit} (git archive)" if FROZEN else
             f"the working tree at {commit}{' + uncommitted changes in celery_keyed/' if dirty else ''}")
    return f"Python {platform.python_version()}; " + ", ".join(f"{k} {v}" for k, v in found.items()) + f"; {where}"


# -- the report ---------------------------------------------------------------------------------------------------


def spread(values: list[float], fmt: str = "{:.2f}") -> str:
    values = [v for v in values if v == v]
    if not values:
        return "—"
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def cell_ms(results: list[Result], q: float, wl: Workload) -> str:
    if not wl.key_bound:
        return "(slot-bound)"
    values = [pct(r.handoffs, q) * 1000 for r in results if r.handoffs]
    return spread(values, "{:.0f}") if values else "—"


def report(results: list[Result], workloads: list[Workload], systems: list[System],
           skipped: dict[str, str]) -> str:
    lines: list[str] = []
    for wl in workloads:
        ideal = "throughput" if wl.throughput else f"ideal {wl.ideal:.2f} s"
        lines += ["", f"**{wl.name}**: {wl.label}, {wl.tasks} tasks ({ideal})", ""]
        mine = {s.name: [r for r in results if r.workload == wl.name and r.system == s.name] for s in systems}
        keyed = mine.get("keyed") or []
        plain = mine.get("plain") or []
        if wl.throughput:
            lines += ["| system | tasks/s | vs plain | celery-keyed vs it | peak/K | msgs/task | retries/task |"
                      " refused | failed | lost | unfinished |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        else:
            lines += ["| system | makespan / ideal | it / celery-keyed | peak per key (K) | handoff p50 ms |"
                      " handoff p99 ms | msgs/task | retries/task | refused | failed | lost | unfinished |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for s in systems:
            rs = mine[s.name]
            if s.name in skipped:
                lines.append(f"| {s.label} | {skipped[s.name]} |" + " |" * (9 if wl.throughput else 10))
                continue
            if not rs:
                why = ("n/a: K = 1 only" if s.k1_only and wl.limit > 1 else
                       "not run (slow defaults: W1, W3, one run)" if s.slow else "not run")
                lines.append(f"| {s.label} | {why} |" + " |" * (9 if wl.throughput else 10))
                continue
            errors = [r.error for r in rs if r.error]
            ok = [r for r in rs if not r.error]
            if not ok:
                lines.append(f"| {s.label} | error: {errors[0][:80]} |" + " |" * (9 if wl.throughput else 10))
                continue
            peak = max(r.peak for r in ok)
            over = sum(r.over_k for r in ok)
            peak_cell = f"{peak} ({wl.limit})" + (" **K exceeded**" if over else "")
            def per_run(values: list[float]) -> str:
                return spread(values, "{:.0f}") if any(values) else "0"

            counts = (f"{spread([r.messages for r in ok])} | {spread([r.retries / r.tasks for r in ok])} | "
                      f"{per_run([r.refused for r in ok])} | {per_run([r.failed for r in ok])} | "
                      f"{per_run([r.lost for r in ok])} | {per_run([r.unfinished for r in ok])}")
            unfinished = any(not r.finished for r in ok)
            if wl.throughput:
                rate = statistics.median(r.rate for r in ok)
                vs_plain = (f"{rate / statistics.median(r.rate for r in plain):.2f}"
                            if plain and not any(r.error for r in plain) else "—")
                vs_keyed = (f"{statistics.median(r.rate for r in keyed) / rate:.2f}"
                            if keyed and not any(r.error for r in keyed) else "—")
                lines.append(f"| {s.label} | {spread([r.rate for r in ok], '{:.0f}')} | {vs_plain} | {vs_keyed} | "
                             f"{peak_cell} | {counts} |")
            else:
                ratio = spread([r.ratio for r in ok])
                ran = statistics.median(r.completed for r in ok)
                if ran < wl.tasks:  # refused or failed tasks never ran: the makespan covers only the others
                    ratio += f" (only {ran:.0f} of {wl.tasks} ran)"
                if unfinished:
                    ratio = f"> {max(r.waited for r in ok) / wl.ideal:.0f} (stopped at the timeout)"
                vs_keyed = "—"
                if keyed and not any(r.error or not r.finished for r in keyed) and not unfinished:
                    mid = statistics.median(r.ratio for r in ok) / statistics.median(r.ratio for r in keyed)
                    vs_keyed = f"{mid:.2f}"
                lines.append(f"| {s.label} | {ratio} | {vs_keyed} | {peak_cell} | {cell_ms(ok, 0.5, wl)} | "
                             f"{cell_ms(ok, 0.99, wl)} | {counts} |")
    return "\n".join(lines)


def write_docs(section: str) -> None:
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{section.strip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOCS.write_text(text)


def docs_section(body: str) -> str:
    return """## celery-keyed side by side with its peers (`python -m bench.peers`)

```sh
make bench-peers                 # all systems x W1-W6, 3 repeats (~20 min); QUICK=1: one run of W1, W2, W6
make bench-peers DOCS=1          # the same, and write this section (between its markers) with the new table
.venv/bin/python -m bench.peers --systems plain,cookbook,keyed --workloads W1,W2 --repeats 5
```

One command runs every system on the same machine, the same PostgreSQL (durable) and Redis, in one run, and
prints ratios. It holds `flock $HOME/.celery-keyed-bench.lock` for the whole run and records the load average
before and after each run of a workload and of the whole. The repeats interleave the systems (each repeat
rotates their order, every other one reversed). celery-keyed runs from a frozen copy of `celery_keyed/` at
HEAD (`git archive`), so edits to the working tree during a run cannot change what is measured.

- **Systems**, each with 8 execution slots (2 workers x 4 processes, prefetch 1, acks_late where it
  applies), each worker our own code (`bench/peers/sys_*.py`): plain Celery (no keys: the ceiling, which
  exceeds K); the Celery cookbook lock (`SET NX` for K = 1, a Redis counter semaphore for K > 1) taken at
  task start with `self.retry(countdown=0.1)` while it is held, with `max_retries=None` and with Celery's
  default `max_retries` (3: its MaxRetriesExceededError failures are counted); celery-once (`QueueOnce`
  keyed on the key, graceful: a publish while the key is queued or running is refused and counted; K = 1
  only); procrastinate `lock=` (default polling, 5 s, and `fetch_job_polling_interval=0.1`; K = 1 only);
  Dramatiq `ConcurrentRateLimiter` on Redis retrying on `RateLimitExceeded` (its default backoff, 15 s
  minimum, and a tuned 0.1-1 s); PgQueuer with one entrypoint per key and `concurrency_limit=K` (on asyncpg;
  its key set is fixed when its workers start, so they are started per workload with that run's keys); and
  celery-keyed with its README's settings (`worker_prefetch_multiplier = 1`, `celery_keyed.install(app)`,
  the K > 1 names in `keyed_concurrency_limits`). The peers run from `.bench-venv/`
  (`bench/requirements-peers.txt`, installed by the first run); a peer that cannot be installed gets a
  "not installed" row.
- **Workloads** (published round-robin over the keys, as bench.gate, to workers already running; 50 ms
  tasks): W1 5 keys x 40, K = 1 · W2 one gate K = 4 x 200 · W3 50 keys x 4, K = 1 · W4 20 keys x 50,
  K = 1 · W5 20 keys x 50, K = 2 · W6 1,000 distinct keys x 3,000 trivial tasks (throughput; the keys are
  new in every run: celery-keyed creates their ledger rows, unlike bench.gate's warm keys).
- **Measures**: makespan / ideal (ideal = max(per-key work / K, all work / 8); makespan from the first
  start to the last end the task bodies recorded), median of the repeats with min-max; "it / celery-keyed"
  is that system's median over celery-keyed's (> 1: celery-keyed finished first). The peak per key and the
  handoffs come from the observer: every task body RPUSHes its own start and end to Redis, never a system's
  own books. Handoff = the i-th end of a key to its (i+K)-th start, p50 / p99 per run (median of the runs),
  shown for W1 and W2 only, where the busiest key sets the ideal; on W3-W5 the 8 slots set it and a key's
  next task also waits for a slot. Messages per task: Celery, Redis `LPUSH` calls (publish, retries and
  redeliveries) over the tasks; Dramatiq, every enqueue (a retry is two: to the delay queue, then back);
  procrastinate and PgQueuer, job rows inserted (neither re-inserts). Per run (median, min-max): refused
  (celery-once), failed (MaxRetriesExceededError, dead-lettered), lost (neither observed, failed nor refused
  once the run ended) and unfinished (still pending when a run was stopped at max(60 s, 8 x ideal)).
- celery-once's makespan covers only the tasks it accepted: read it with its refusals. The slow defaults
  (procrastinate's 5 s polling, Dramatiq's 15 s backoff) run W1 and W3 once (`--all-workloads` for all), each
  run stopped after 25 s (`--slow-timeout`): their "> N" is where the run stood then.

""" + body + "\n"
