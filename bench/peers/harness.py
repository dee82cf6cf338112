"""celery-keyed side by side with what Celery users use today, in one run (DESIGN §8).

    python -m bench.peers [--quick] [--repeats 3] [--systems a,b] [--workloads W1,W2] [--write-docs]

Same machine, same PostgreSQL (durable, fsync on) and Redis (``celery_keyed.testing``, or ``KEYED_DATABASE_URL``
/ ``CELERY_BROKER_URL``), one run. Every system gets 8 execution slots (2 workers x 4), prefetch 1, acks_late
where it applies; its workers are real processes running this benchmark's own code (``bench/peers/sys_*.py``).
The peers run from their own virtualenv, ``.bench-venv/`` (``bench/requirements-peers.txt``, installed on first
use); a peer that cannot be installed or imported gets a "not installed" row.

Workloads (50 ms tasks unless said; published round-robin over the keys, or key by key with --order key-major;
the workers already running):
W1 5 keys x 40, K = 1 · W2 one gate K = 4 x 200 · W3 50 keys x 4, K = 1 · W4 20 keys x 50, K = 1 ·
W5 20 keys x 50, K = 2 · W6 1,000 distinct uncontended keys x 3,000 trivial tasks (throughput).

Measures per system x workload (median of the repeats, with min-max; the systems are interleaved across repeats):
makespan / ideal (ideal = max(per-key work / K, all work / 8); makespan = last end - first start, as the task
bodies recorded them), the peak per key seen by the observer (the task bodies RPUSH their own start and end to
Redis: never a system's own books), handoff p50 / p99 (the i-th end of a key -> its (i+K)-th start; shown where
the busiest key sets the ideal, W1 and W2: elsewhere a key's next task also waits for a free slot), broker
messages per task (Celery: Redis LPUSH calls, the publish included; Dramatiq: every enqueue; procrastinate and
PgQueuer: job rows inserted), refusals and retries per task, tasks failed and lost, and W6's throughput.

A run holds ``flock $HOME/.celery-keyed-bench.lock`` (the command re-executes itself under ``flock``) and
records the load average before and after. Benchmarks are not tests: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.peers import observer as obs

ROOT = Path(__file__).resolve().parents[2]
PEERS_VENV = ROOT / ".bench-venv"
REQUIREMENTS = ROOT / "bench" / "requirements-peers.txt"
LOCK = Path(os.environ.get("HOME", "/tmp")) / ".celery-keyed-bench.lock"
ENV_LOCKED = "CELERY_KEYED_BENCH_LOCKED"
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- bench.peers:begin -->", "<!-- bench.peers:end -->"
SLOTS = 8  # 2 workers x 4


# -- systems ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    name: str
    label: str
    module: str  # bench.peers.sys_*
    venv: str  # "main" (.venv) or "peers" (.bench-venv)
    family: str  # celery | dramatiq | procrastinate | pgqueuer
    imports: str = ""  # what must import in its venv
    k1_only: bool = False  # cannot express K > 1
    slow: bool = False  # defaults that wait seconds between tries: W1 and W3, once, unless --all-workloads
    note: str = ""


SYSTEMS = [
    System("plain", "plain Celery (no keys)", "bench.peers.sys_celery", "main", "celery"),
    System("cookbook", "cookbook lock + retry(countdown=0.1), max_retries=None", "bench.peers.sys_celery", "main",
           "celery"),
    System("cookbook-default", "cookbook lock + retry(countdown=0.1), default max_retries (3)",
           "bench.peers.sys_celery", "main", "celery"),
    System("once", "celery-once (refuses while queued)", "bench.peers.sys_celery", "peers", "celery",
           imports="celery_once", k1_only=True),
    System("procrastinate", "procrastinate lock=, default polling (5 s)", "bench.peers.sys_procrastinate", "peers",
           "procrastinate", imports="procrastinate", k1_only=True, slow=True),
    System("procrastinate-0.1", "procrastinate lock=, fetch_job_polling_interval=0.1",
           "bench.peers.sys_procrastinate", "peers", "procrastinate", imports="procrastinate", k1_only=True),
    System("dramatiq", "Dramatiq ConcurrentRateLimiter, default backoff (15 s min)", "bench.peers.sys_dramatiq",
           "peers", "dramatiq", imports="dramatiq", slow=True),
    System("dramatiq-tuned", "Dramatiq ConcurrentRateLimiter, backoff 0.1-1 s", "bench.peers.sys_dramatiq",
           "peers", "dramatiq", imports="dramatiq"),
    System("pgqueuer", "PgQueuer, one entrypoint per key, concurrency_limit=K", "bench.peers.sys_pgqueuer",
           "peers", "pgqueuer", imports="pgqueuer"),
    System("keyed", "celery-keyed (README settings)", "bench.peers.sys_celery", "main", "celery"),
]
BY_NAME = {s.name: s for s in SYSTEMS}
#: The whole limit of a run of the slow defaults (Dramatiq's 15 s backoff, procrastinate's 5 s polling): enough to
#: show that they stall (W1 never finishes within a minute either), short enough to keep the full run under 20 min.
SLOW_TIMEOUT = 25.0


# -- workloads ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    keys: int
    per_key: int
    limit: int
    seconds: float

    @property
    def label(self) -> str:
        what = "trivial" if self.seconds == 0 else f"{self.seconds * 1000:.0f} ms"
        return f"{self.keys} key(s) x {self.per_key}, K = {self.limit}, {what}"

    @property
    def tasks(self) -> int:
        return self.keys * self.per_key

    @property
    def ideal(self) -> float:
        return max(self.per_key * self.seconds / self.limit, self.tasks * self.seconds / SLOTS)

    @property
    def throughput(self) -> bool:
        return self.seconds == 0

    @property
    def key_bound(self) -> bool:
        """The ideal is set by the busiest key (W1, W2): each of its gaps is a handoff. Where the 8 slots set it
        (W3-W5), a key's next task also waits for a slot, so its gaps are not the system's handoffs."""
        return self.seconds > 0 and self.per_key * self.seconds / self.limit >= self.tasks * self.seconds / SLOTS

    def scaled(self, scale: float, seconds: float | None) -> Workload:
        per_key = max(self.limit + 1, round(self.per_key * scale)) if scale != 1 else self.per_key
        keys = self.keys if self.name != "W6" or scale == 1 else max(10, round(self.keys * scale))
        sec = self.seconds if seconds is None or self.seconds == 0 else seconds
        return Workload(self.name, keys, per_key, self.limit, sec)


WORKLOADS = {
    "W1": Workload("W1", 5, 40, 1, 0.05),
    "W2": Workload("W2", 1, 200, 4, 0.05),
    "W3": Workload("W3", 50, 4, 1, 0.05),
    "W4": Workload("W4", 20, 50, 1, 0.05),
    "W5": Workload("W5", 20, 50, 2, 0.05),
    "W6": Workload("W6", 1000, 3, 1, 0.0),
}


#: The publish order: "round-robin" over the keys (as bench.gate), or "key-major" (each key's tasks in one burst,
#: key after key: a FIFO broker then hands the workers runs of one key). W6 is always round-robin (uncontended).
ORDER = ["round-robin"]


def task_list(wl: Workload, tag: str) -> list[tuple[str, str, float, int]]:
    """(key, task id, seconds, K) in publish order. The key's name is the workload's (``w2:...``)."""
    keys = [f"{wl.name.lower()}:{tag}-{i}" for i in range(wl.keys)]
    if ORDER[0] == "key-major" and not wl.throughput:
        return [(key, f"{tag}-{j}-{i}", wl.seconds, wl.limit) for i, key in enumerate(keys) for j in range(wl.per_key)]
    return [(key, f"{tag}-{j}-{i}", wl.seconds, wl.limit) for j in range(wl.per_key) for i, key in enumerate(keys)]


# -- results ------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    system: str
    workload: str
    repeat: int
    tasks: int
    completed: int = 0
    duplicates: int = 0
    refused: int = 0
    failed: int = 0
    retries: int = 0
    messages: float = 0.0
    makespan: float = 0.0
    ratio: float = float("nan")  # makespan / ideal
    rate: float = 0.0  # tasks/s (W6)
    peak: int = 0  # the most tasks of one key running at once, as observed
    over_k: int = 0  # keys whose peak exceeded K
    handoffs: list[float] = field(default_factory=list)
    finished: bool = True
    waited: float = 0.0
    load: tuple[float, float] = (0.0, 0.0)
    error: str = ""

    @property
    def lost(self) -> int:
        return max(0, self.tasks - self.completed - self.refused - self.failed) if self.finished else 0

    @property
    def unfinished(self) -> int:
        return 0 if self.finished else self.tasks - self.completed - self.refused - self.failed


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def analyse(res: Result, wl: Workload, rows: list[list[str]]) -> None:
    seen: set[str] = set()
    by_key: dict[str, list[tuple[float, float]]] = {}
    for start, end, key, task_id, _pid in rows:
        if task_id in seen:
            res.duplicates += 1
        seen.add(task_id)
        by_key.setdefault(key, []).append((float(start), float(end)))
    res.completed = len(seen)
    if not rows:
        return
    first = min(s for v in by_key.values() for s, _ in v)
    last = max(e for v in by_key.values() for _, e in v)
    res.makespan = last - first
    res.ratio = res.makespan / wl.ideal if wl.ideal > 0 else float("nan")
    res.rate = len(rows) / res.makespan if res.makespan > 0 else float("nan")
    for intervals in by_key.values():
        events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
        running = peak = 0
        for _, delta in events:
            running += delta
            peak = max(peak, running)
        res.peak = max(res.peak, peak)
        res.over_k += peak > wl.limit
        starts = sorted(s for s, _ in intervals)
        ends = sorted(e for _, e in intervals)
        for i in range(len(starts) - wl.limit):
            res.handoffs.append(max(0.0, starts[i + wl.limit] - ends[i]))


# -- processes ----------------------------------------------------------------------------------------------------

#: A frozen copy of celery_keyed/ at HEAD (``git archive``): other engineers edit the working tree while a
#: benchmark runs, and a half-saved module must not break a run. Empty with --working-tree.
FROZEN: list[Path] = []


def freeze(into: Path) -> str:
    """Copy celery_keyed/ as committed at HEAD into ``into``; every process of the run imports it first."""
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD", "celery_keyed"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    FROZEN[:] = [into]
    sys.path.insert(0, str(into))
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def workdir() -> Path:
    """The processes' working directory: ``python -m`` puts it first on sys.path, before PYTHONPATH."""
    return FROZEN[0] if FROZEN else ROOT



def python_of(system: System) -> str:
    return str(PEERS_VENV / "bin" / "python") if system.venv == "peers" else sys.executable


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    name: str
    log: Path

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self, grace: float = 15.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Bench:
    database_urls: dict[str, str]  # family -> PostgreSQL URL (celery-keyed's ledger, procrastinate, PgQueuer)
    broker_url: str
    observer_url: str
    redis: Any  # the observer's client (db of the observer)
    broker: Any  # the broker's client (its db: flushed between systems)
    logs: Path
    seq: int = 0

    def tag(self) -> str:
        self.seq += 1
        return f"r{self.seq}{uuid.uuid4().hex[:5]}"

    def env(self, system: System, queue: str, worker: str = "", keys_file: str = "") -> dict[str, str]:
        env = dict(os.environ)
        for var in ("VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(var, None)
        env.update({
            obs.ENV_SYSTEM: system.name,
            obs.ENV_OBSERVER: self.observer_url,
            obs.ENV_BROKER: self.broker_url,
            obs.ENV_DATABASE: self.database_urls.get(system.family if system.family != "celery" else "keyed", ""),
            obs.ENV_WORKER: worker,
            obs.ENV_KEYS: keys_file,
            "BENCH_PEERS_QUEUE": queue,
            "dramatiq_queue_prefetch": "1",
            "PYTHONPATH": os.pathsep.join([*([str(FROZEN[0])] if FROZEN else []), str(ROOT)]),
            "PYTHONWARNINGS": "ignore",
        })
        return env

    def worker_cmd(self, system: System, queue: str, name: str) -> list[str]:
        py = python_of(system)
        if system.family == "celery":
            return [py, "-m", "celery", "-A", system.module, "worker", "-P", "prefork", "-c", "4", "-n",
                    f"{name}@bench", "-Q", queue, "--prefetch-multiplier", "1", "--without-gossip",
                    "--without-mingle", "--without-heartbeat", "-l", "WARNING"]
        if system.family == "dramatiq":
            return [py, "-m", "dramatiq", system.module, "--processes", "4", "--threads", "1", "--queues", queue]
        return [py, "-m", system.module, "worker"]

    @contextlib.contextmanager
    def workers(self, system: System, queue: str, keys: dict[str, int] | None = None) -> Iterator[list[Proc]]:
        keys_file = ""
        if keys is not None:
            keys_file = str(self.logs / f"keys-{queue}.json")
            Path(keys_file).write_text(json.dumps(keys))
        self.redis.delete(obs.READY)
        procs: list[Proc] = []
        try:
            for i in range(2):
                name = f"{system.name}-{queue}-{i}"
                log = self.logs / f"{name}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(self.worker_cmd(system, queue, name), cwd=workdir(),
                                            env=self.env(system, queue, name, keys_file), stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                procs.append(Proc(proc, name, log))
            want = 8 if system.family == "dramatiq" else 2  # Dramatiq announces each of its processes
            deadline = time.monotonic() + 120
            while self.redis.llen(obs.READY) < want:
                for p in procs:
                    p.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{system.name}: workers not ready after 120 s:\n{procs[0].tail()}")
                time.sleep(0.05)
            time.sleep(0.5)  # the announce comes just before the consume / fetch loop starts
            yield procs
        finally:
            for p in procs:
                p.stop()
            self.redis.delete(obs.READY)

    def lpush_calls(self) -> int:
        return int(self.broker.info("commandstats").get("cmdstat_lpush", {}).get("calls", 0))

    def run(self, system: System, wl: Workload, queue: str, procs: list[Proc], repeat: int,
            timeout: float, tag: str | None = None) -> Result:
        tag = tag or self.tag()
        run = f"bench:peers:{tag}"
        tasks = task_list(wl, tag)
        res = Result(system.name, wl.name, repeat, len(tasks))
        load0 = os.getloadavg()[0]
        lpush0 = self.lpush_calls()
        log = self.logs / f"publish-{tag}.log"
        with open(log, "wb") as err:
            pub = subprocess.Popen([python_of(system), "-m", system.module, "publish"], cwd=workdir(),
                                   env=self.env(system, queue), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=err, start_new_session=True)
            assert pub.stdin is not None
            pub.stdin.write(json.dumps({"run": run, "queue": queue, "tasks": tasks}).encode())
            pub.stdin.close()
        started = time.monotonic()
        published: dict[str, Any] | None = None
        stats = obs.stats_key(run)
        while True:
            if published is None and pub.poll() is not None:
                assert pub.stdout is not None
                out = pub.stdout.read().decode()
                if pub.returncode != 0:
                    raise RuntimeError(f"{system.name} publisher exited {pub.returncode}:\n"
                                       f"{log.read_text(errors='replace')[-3000:]}")
                published = json.loads(out.strip().splitlines()[-1])
            refused = int(published["refused"]) if published else 0
            failed = int(self.redis.hget(stats, "failed") or 0)
            if published is not None and self.redis.llen(run) + refused + failed >= len(tasks):
                break
            for p in procs:
                p.check()
            if time.monotonic() - started > timeout:
                res.finished = False
                break
            time.sleep(0.05)
        res.waited = time.monotonic() - started
        if published is None:  # the publisher itself did not finish in time
            pub.kill()
            pub.wait()
            published = {"refused": 0}
        time.sleep(0.3)  # a task run twice would show up now
        counters = {k.decode(): int(v) for k, v in self.redis.hgetall(stats).items()}
        res.refused = int(published["refused"])
        res.failed = counters.get("failed", 0)
        res.retries = counters.get("retries", 0)
        if system.family == "celery":
            res.messages = (self.lpush_calls() - lpush0) / len(tasks)
        elif system.family == "dramatiq":
            res.messages = counters.get("messages", 0) / len(tasks)
        else:  # one job row per published task; neither retries nor re-inserts
            res.messages = (len(tasks) - res.refused) / len(tasks)
        rows = [entry.decode().split() for entry in self.redis.lrange(run, 0, -1)]
        if os.environ.get("BENCH_PEERS_DUMP"):  # the raw rows, for a trace: start end key task_id pid
            dump = Path(os.environ["BENCH_PEERS_DUMP"]) / f"{system.name}-{wl.name}-{repeat}.txt"
            dump.parent.mkdir(parents=True, exist_ok=True)
            dump.write_text("\n".join(" ".join(r) for r in rows) + "\n")
        analyse(res, wl, rows)
        res.load = (load0, os.getloadavg()[0])
        self.redis.delete(run, stats)
        return res


# -- servers and the peers' virtualenv ----------------------------------------------------------------------------


def peers_venv(install: bool) -> str:
    """Make sure .bench-venv/ has bench/requirements-peers.txt; return "" or why it could not."""
    stamp = PEERS_VENV / ".requirements.sha256"
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if (PEERS_VENV / "bin" / "python").exists() and stamp.exists() and stamp.read_text() == digest:
        return ""
    if not install:
        return "no .bench-venv (run without --no-install to create it)"
    print(f"installing the peers into {PEERS_VENV} (bench/requirements-peers.txt) ...", flush=True)
    try:
        if not (PEERS_VENV / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
        (PEERS_VENV / ".gitignore").write_text("*\n")
        done = subprocess.run([str(PEERS_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                               "--progress-bar", "off", "-r", str(REQUIREMENTS)],
                              capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not create .bench-venv: {exc}"
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return "pip install -r bench/requirements-peers.txt failed (see above)"
    stamp.write_text(digest)
    return ""


def importable(system: System) -> str:
    """"" if the system can run here, else why not."""
    if system.venv != "peers":
        return ""
    py = python_of(system)
    if not Path(py).exists():
        return "not installed (no .bench-venv)"
    check = subprocess.run([py, "-c", f"import {system.imports}"], capture_output=True, text=True)
    last = (check.stderr.strip().splitlines() or ["?"])[-1]
    return "" if check.returncode == 0 else f"not installed ({last})"


@contextlib.contextmanager
def servers(families: set[str]) -> Iterator[tuple[dict[str, str], str, str, str]]:
    """({family: database URL}, broker URL, observer URL, description)."""
    import psycopg
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    from celery_keyed.ledger import migrate
    from celery_keyed.testing import start_postgres, start_redis

    with start_postgres(durable=True) as pg, start_redis() as rd:
        admin_url = make_url(pg.url).set(drivername="postgresql").render_as_string(hide_password=False)
        suffix = uuid.uuid4().hex[:8]
        names = {family: f"bench_peers_{family}_{suffix}" for family in families}
        with psycopg.connect(admin_url, autocommit=True) as admin:
            for name in names.values():
                admin.execute(f'CREATE DATABASE "{name}"')
            row = admin.execute("SHOW server_version").fetchone()
            fsync = admin.execute("SHOW fsync").fetchone()
        urls = {family: pg.url_for(name) for family, name in names.items()}
        try:
            if "keyed" in urls:
                engine = sa.create_engine(urls["keyed"])
                try:
                    migrate(engine)
                finally:
                    engine.dispose()
            for family in ("procrastinate", "pgqueuer"):
                if family in urls:
                    system = next(s for s in SYSTEMS if s.family == family)
                    env = dict(os.environ, PYTHONPATH=str(ROOT), **{obs.ENV_DATABASE: urls[family],
                                                                     obs.ENV_BROKER: rd.url})
                    subprocess.run([python_of(system), "-m", system.module, "schema"], cwd=workdir(), env=env,
                                   check=True, capture_output=True)
            import redis

            version = redis.Redis.from_url(rd.url).info("server").get("redis_version", "?")
            described = (f"PostgreSQL {row[0] if row else '?'} (fsync={fsync[0] if fsync else '?'}), "
                         f"Redis {version}, both {'started by the benchmark' if pg.managed else 'given'}")
            base = rd.url.rsplit("/", 1)[0]
            yield urls, f"{base}/0", f"{base}/1", described
        finally:
            with psycopg.connect(admin_url, autocommit=True) as admin:
                for name in names.values():
                    admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def cleanup(bench: Bench, system: System) -> None:
    """Nothing of one system's run may reach the next: the broker's db is flushed, the peers' job tables
    emptied (a run stopped by its timeout leaves jobs behind)."""
    bench.broker.flushdb()
    if system.family in ("procrastinate", "pgqueuer"):
        import psycopg

        url = bench.database_urls[system.family].replace("postgresql+psycopg://", "postgresql://")
        table = "procrastinate_jobs" if system.family == "procrastinate" else "pgqueuer"
        with psycopg.connect(url, autocommit=True) as conn, contextlib.suppress(psycopg.Error):
            conn.execute(f"DELETE FROM {table}")


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


# -- main ---------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
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


def locked(argv: list[str], lock_wait: float | None) -> None:
    """Re-execute this command under ``flock $HOME/.celery-keyed-bench.lock``: one benchmark at a time."""
    if os.environ.get(ENV_LOCKED):
        return
    LOCK.touch(exist_ok=True)
    print(f"waiting for {LOCK} (flock) ...", flush=True)
    wait = ["-w", str(lock_wait), "-E", "75"] if lock_wait is not None else []
    os.execvpe("flock", ["flock", *wait, str(LOCK), sys.executable, "-m", "bench.peers", *argv],
               dict(os.environ, **{ENV_LOCKED: "1"}))


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse(raw)
    if not args.no_lock:
        locked(raw, args.lock_wait)
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
