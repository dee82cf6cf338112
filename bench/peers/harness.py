"""bench.peers' harness: the servers (one durable PostgreSQL with a database per family, one Redis), the peers'
virtualenv, a frozen copy of ``celery_keyed/``, the worker and publisher processes of a system, and one run of a
workload timed by the observer (``Bench.run``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.peers import observer as obs
from bench.peers.plan import SYSTEMS, Result, System, Workload, analyse, task_list
from bench.procs import stop_group

ROOT = Path(__file__).resolve().parents[2]
PEERS_VENV = ROOT / ".bench-venv"
REQUIREMENTS = ROOT / "bench" / "requirements-peers.txt"


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
        stop_group(self.proc, grace)


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
