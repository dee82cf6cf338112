"""The chaos harness: real prefork workers on two hostnames, real Redis and PostgreSQL that it breaks on a
seeded schedule, and an independent observer of task bodies that checks the bound and the books.

Run it from pytest (``tests/chaos/test_chaos.py``: a short variant in the fast suite, the long one with
``make chaos``) or by hand, e.g. to replay a failing schedule::

    .venv/bin/python -m tests.chaos.harness --seed 1234 [--long] [--tasks N] [--keep]

What it does:

- 4 workers (``a1@hostA a2@hostA b1@hostB b2@hostB``, prefork, ``-c 2``), 20 mutex keys ``m:0``..``m:19``
  (unconfigured: K = 1), one gate ``gate:api`` (name ``gate`` configured with K = 3) and readers and writers on
  ``doc:0`` ``doc:1`` (name ``doc``, K = 3: ``chaos.read`` shared, ``chaos.write`` exclusive); acks_late tasks of
  random length (mostly 20-300 ms, some up to 1.5 s, a few longer than the lease), a short lease
  (``keyed_lease`` 4 s) and a short Redis ``visibility_timeout`` (6 s: long tasks are redelivered while they
  run); Redis with an fsynced append-only file, so a restart or an outage loses nothing.
- Faults, seeded and printed: SIGKILL of a worker's main process (the report says whether its pool children
  outlived it; the observer sees their bodies either way) and
  of a pool child running a body, warm shutdown (SIGTERM to the main process, as systemd does) while a body
  longer than the lease runs, cold shutdown (SIGQUIT: Celery cancels the running tasks, SIGTERM to their pool
  processes) while a body that handles SIGTERM with a cleanup runs, each followed by a restart; PostgreSQL
  restart and an outage longer than the lease; Redis restart and an outage longer than the lease; a silent network
  between one worker and PostgreSQL; a reshard: the ``doc`` name's shard count changed up and down (1 -> 2 -> 4 -> 1,
  ...; stored with a configuration version above the workers', so a restarted worker keeps it) and its limit lowered
  by an override meanwhile, each step after a burst of readers with a writer among them. And in the
  task mix: a quarter of the bodies handle SIGTERM with a cleanup of 0.2-1.5 s, and a few get a hard time limit
  shorter than themselves (billiard fails them, then sends SIGTERM and SIGKILL 0.1 s later; booked failed).
- The observer (``tests/chaos/proj.py``): each body writes ``start`` / ``end`` lines to its own process's
  file, and a heartbeat every 5 ms. A body without ``end`` was killed; its end is the moment its process died,
  bounded from above by the harness's own ``kill`` (exact: taken after the signal was sent) or, for deaths the
  harness did not cause (self-fencing, Celery terminating a child), by a pidfd watcher that notes the exit within
  milliseconds; its heartbeat bounds it from below. An overlap that exists only inside that uncertainty window
  is reported as ambiguous, not as a breach.

Checks after the drain: peak bodies per key <= K at every instant (a body that cleans up after SIGTERM runs until
its ``end … cleanup`` line, or until its process died); on a ``doc`` key, no writer at the same instant as any other
body of its key and at most K readers at once (K as configured: the reshard only lowers it for a while); every task
id has exactly one terminal outcome in the books (``keyed_tasks``), ``completed`` with a matching SUCCESS result
(``failed`` with a FAILURE result for the bodies given a hard time limit); no open books, claims or waiting rows;
reconcile drift 0 (every reconcile run during the chaos, ``keyed_events``, and a final one); no worker died that
the harness did not kill; time from the end of the last fault to drained.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

from celery_keyed.partition import SilentProxy
from celery_keyed.testing import PostgresServer, RedisServer, start_postgres, start_redis
from tests.chaos.proj import now

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("a1@hostA", "a2@hostA", "b1@hostB", "b2@hostB")
#: The worker that reaches PostgreSQL through a proxy that can go silent (the ``pg_partition_outage`` fault): its
#: connections stay open and get no answer, no refusal, no reset, as behind a firewall that drops packets.
PARTITIONED = "b2@hostB"
GATE_KEY = "gate:api"
#: Readers and writers: tasks of ``doc:N`` keys (name ``doc``, K = ``Config.doc_limit``), ``chaos.read`` shared and
#: ``chaos.write`` exclusive; the ``reshard`` fault changes the name's shard count and limit while they run.
DOC_NAME = "doc"
WORKER_FAULTS = ("kill_main", "kill_child", "warm_shutdown", "cold_shutdown")
FAULT_KINDS = (
    "kill_main",
    "kill_child",
    "warm_shutdown",
    "cold_shutdown",
    "pg_restart",
    "pg_outage",
    "redis_restart",
    "redis_outage",
    "pg_partition_outage",
)
#: Shard-count and limit changes while readers and writers run (the ``reshard`` fault): on by default;
#: ``CHAOS_RESHARD=0`` leaves them out (to tell a shard change's failure from another fault's).
RESHARD = os.environ.get("CHAOS_RESHARD", "1") != "0"


# ----------------------------------------------------------------------------------------------------------
# Configuration and the fault schedule


@dataclass
class Config:
    seed: int
    tasks: int
    submit_over: float  # seconds over which the tasks are published
    faults: list[Fault]
    lease: float = 4.0
    visibility_timeout: float = 6.0
    concurrency: int = 2
    mutex_keys: int = 20
    gate_limit: int = 3
    long_fraction: float = 0.04
    cleanup_fraction: float = 0.25  # bodies that handle SIGTERM with a cleanup (0.2-1.5 s)
    time_limit_fraction: float = 0.02  # bodies given a hard time limit shorter than themselves (booked failed)
    drain_timeout: float = 120.0
    doc_keys: int = 2  # doc:0.. (readers and writers, K = doc_limit)
    doc_limit: int = 3
    doc_fraction: float = 0.15  # of the tasks published
    writer_fraction: float = 0.3  # of the doc tasks

    @property
    def doc_key_names(self) -> list[str]:
        return [f"{DOC_NAME}:{i}" for i in range(self.doc_keys)]

    def describe(self) -> str:
        lines = [
            f"chaos seed={self.seed} tasks={self.tasks} submit_over={self.submit_over:.0f}s lease={self.lease}s "
            f"visibility_timeout={self.visibility_timeout}s workers={len(WORKERS)}x-c{self.concurrency} "
            f"keys={self.mutex_keys} mutex + {GATE_KEY} (K={self.gate_limit}) + {self.doc_keys} {DOC_NAME}:N "
            f"(K={self.doc_limit}, {self.writer_fraction:.0%} writers) "
            f"cleanup on SIGTERM={self.cleanup_fraction:.0%} hard time limits={self.time_limit_fraction:.0%}",
            "fault schedule (seconds from the first publish):",
        ]
        lines += [f"  {f.at:7.1f}s  {f.kind:<14} {f.target or '':<10} {f.duration:5.1f}s" for f in self.faults]
        return "\n".join(lines)


@dataclass
class Fault:
    at: float
    kind: str
    target: str | None = None  # a worker name, for worker faults
    duration: float = 0.0  # outage length, or pause before a worker is started again


def short_config(seed: int) -> Config:
    """The fast-suite variant (<= 90 s): a few hundred tasks, one of each fault that matters most."""
    rng = random.Random(seed)
    lease = 4.0
    rest = ["kill_child", "kill_main", "redis_outage", "pg_restart", "cold_shutdown", "pg_partition_outage"]
    rng.shuffle(rest)
    if RESHARD:
        rest.insert(rng.randrange(len(rest) + 1), "reshard")
    kinds = ["warm_shutdown", *rest]  # the warm shutdown first: the first tasks published are long ones
    faults, at = [], 3.0
    for kind in kinds:
        target = rng.choice(WORKERS) if kind in WORKER_FAULTS else None
        duration = lease + 2.0 if kind.endswith("outage") else rng.uniform(0.3, 1.5)
        faults.append(Fault(round(at, 1), kind, target, round(duration, 1)))
        at += rng.uniform(4.0, 6.0) + _fault_length(kind, duration)
    return Config(
        seed=seed, tasks=300, submit_over=at, faults=faults, lease=lease, long_fraction=0.05, drain_timeout=40.0
    )


def long_config(seed: int, tasks: int = 3000) -> Config:
    """``make chaos``: a few thousand tasks over about four minutes, a fault every 8-16 s, every kind."""
    rng = random.Random(seed)
    lease = 4.0
    kinds = [*FAULT_KINDS, *(["reshard"] if RESHARD else [])] * 3
    rng.shuffle(kinds)
    faults, at = [], 5.0
    for kind in kinds:
        target = rng.choice(WORKERS) if kind in WORKER_FAULTS else None
        duration = rng.uniform(lease + 1.0, lease * 2.5) if kind.endswith("outage") else rng.uniform(0.2, 3.0)
        faults.append(Fault(round(at, 1), kind, target, round(duration, 1)))
        at += rng.uniform(8.0, 16.0) + _fault_length(kind, duration)
    return Config(seed=seed, tasks=tasks, submit_over=at, faults=faults, lease=lease, drain_timeout=180.0)


def _fault_length(kind: str, duration: float) -> float:
    """How long a fault lasts past its start (an outage's length; a reshard's steps), roughly."""
    if kind.endswith("outage"):
        return duration
    if kind == "reshard":
        return RESHARD_STEPS * (RESHARD_SETTLE + duration)
    return 0.0


#: A reshard: the shard counts it sets in turn (each path ends at 1, where waiting writers can start again), the
#: limit it lowers the name to after its first step (an operator override, cleared at its last), and how long after a
#: burst of readers and a writer it waits before each step.
RESHARD_PATHS = ((2, 4, 1), (4, 2, 1), (2, 1, 4, 1))
RESHARD_STEPS = 4
RESHARD_LOWERED = 2
RESHARD_SETTLE = 0.3


# ----------------------------------------------------------------------------------------------------------
# Workers


@dataclass
class Workers:
    env: dict[str, str]
    logdir: Path
    concurrency: int
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    generation: collections.Counter[str] = field(default_factory=collections.Counter)
    sessions: list[int] = field(default_factory=list)  # every process group we started (teardown)
    logs: list[Path] = field(default_factory=list)
    expected_exit: set[int] = field(default_factory=set)  # main pids the harness stopped or killed
    lock: threading.Lock = field(default_factory=threading.Lock)
    env_of: dict[str, dict[str, str]] = field(default_factory=dict)  # per worker: what differs from ``env``

    def start(self, name: str) -> subprocess.Popen[bytes]:
        with self.lock:
            gen = self.generation[name]
            self.generation[name] += 1
            log = self.logdir / f"{name.split('@')[0]}.{gen}.log"
            self.logs.append(log)
            cmd = [
                sys.executable, "-m", "celery", "-A", "tests.chaos.proj", "worker", "-P", "prefork",
                "-c", str(self.concurrency), "-n", name, "--without-gossip", "--without-mingle",
                "--without-heartbeat", "-l", "INFO",
            ]  # fmt: skip
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env={**self.env, **self.env_of.get(name, {})},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.procs[name] = proc
            self.sessions.append(proc.pid)
            proc.log = log  # type: ignore[attr-defined]
            return proc

    def wait_ready(self, name: str, timeout: float = 60.0) -> bool:
        proc = self.procs[name]
        log: Path = proc.log  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            if "ready." in log.read_text(errors="replace"):
                return True
            time.sleep(0.1)
        return False

    def children(self, name: str) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.procs[name].pid).children()]
        except psutil.Error:
            return []

    def unexpected_deaths(self) -> list[str]:
        with self.lock:
            return [
                f"{name} (pid {p.pid}) exited {p.returncode}"
                for name, p in self.procs.items()
                if p.poll() is not None and p.pid not in self.expected_exit
            ]

    def supervise(self, died: list[str], stop: threading.Event, rel: Any) -> None:
        """Like systemd's Restart=: a worker that exits without the harness stopping it is noted and started
        again (with the same name) so the run goes on at full strength."""
        while not stop.wait(0.5):
            with self.lock:
                dead = [
                    (name, p)
                    for name, p in self.procs.items()
                    if p.poll() is not None and p.pid not in self.expected_exit
                ]
                for _name, p in dead:
                    self.expected_exit.add(p.pid)
            for name, p in dead:
                died.append(f"{name} (pid {p.pid}) exited {p.returncode} at {rel():.1f}s, log {p.log}")  # type: ignore[attr-defined]
                self.start(name)

    def stop_all(self, kills: Kills) -> None:
        with self.lock:
            procs = list(self.procs.values())
            self.expected_exit.update(p.pid for p in procs)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for pgid in self.sessions:  # orphaned pool children of killed workers too
            kills.killpg(pgid)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


# ----------------------------------------------------------------------------------------------------------
# Deaths: kills the harness sent (exact upper bounds) and exits a pidfd watcher saw


class Kills:
    """Every SIGKILL the harness sends, timed after the signal was sent: a body cannot run past it."""

    def __init__(self) -> None:
        self.by_pid: dict[int, list[float]] = collections.defaultdict(list)
        self.by_pgid: dict[int, list[float]] = collections.defaultdict(list)
        self.lock = threading.Lock()

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> bool:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        t = now()
        if sig == signal.SIGKILL:
            with self.lock:
                self.by_pid[pid].append(t)
        return True

    def killpg(self, pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
            t = now()
            with self.lock:
                self.by_pgid[pgid].append(t)


class ExitWatcher(threading.Thread):
    """Notes when each process that ran a body exits (pidfd), within milliseconds."""

    def __init__(self, directory: Path) -> None:
        super().__init__(name="chaos-exit-watcher", daemon=True)
        self.directory = directory
        self.exits: dict[int, float] = {}
        self.unwatched: set[int] = set()  # gone before we could watch it
        self._fds: dict[int, int] = {}
        self._halt = threading.Event()
        self._seen: set[int] = set()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)

    def _scan(self, poller: select.poll) -> None:
        for entry in os.scandir(self.directory):
            if not entry.name.endswith(".log"):
                continue
            pid = int(entry.name[:-4])
            if pid in self._seen:
                continue
            self._seen.add(pid)
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self.unwatched.add(pid)
                continue
            self._fds[fd] = pid
            poller.register(fd, select.POLLIN)

    def run(self) -> None:
        poller = select.poll()
        while not self._halt.is_set():
            self._scan(poller)
            for fd, _ in poller.poll(5):
                self.exits[self._fds.pop(fd)] = now()
                poller.unregister(fd)
                os.close(fd)
        self._scan(poller)
        for fd, pid in list(self._fds.items()):
            os.close(fd)
            self.unwatched.add(pid)  # still alive at the end, or gone unseen


# ----------------------------------------------------------------------------------------------------------
# The observer's records


@dataclass
class Body:
    task_id: str
    key: str
    pid: int
    pgid: int
    worker: str
    start: float
    end: float | None = None  # its own ``end`` line
    last_alive: float = 0.0  # last heartbeat (killed bodies)
    death: float | None = None  # upper bound of its process's death
    death_exact: bool = False  # the bound is a kill the harness sent
    cleaned_up: bool = False  # its ``end`` came from its SIGTERM handler: stopped, not run to its end

    @property
    def end_hi(self) -> float:
        if self.end is not None:
            return self.end
        return self.death if self.death is not None else self.last_alive

    @property
    def end_lo(self) -> float:
        if self.end is not None:
            return self.end
        if self.death is not None and self.death_exact:
            return self.death
        return self.last_alive


def read_bodies(directory: Path) -> list[Body]:
    bodies: list[Body] = []
    for log in directory.glob("*.log"):
        pid = int(log.stem)
        current: Body | None = None
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 6 and parts[0] == "start":
                current = Body(parts[1], parts[2], pid, int(parts[5]), parts[4], float(parts[3]))
                bodies.append(current)
            elif len(parts) >= 4 and parts[0] == "end" and current is not None and current.task_id == parts[1]:
                current.end = float(parts[3])
                current.cleaned_up = len(parts) >= 5 and parts[4] == "cleanup"
                current = None
        hb = log.with_suffix(".hb")
        if current is not None and hb.exists():
            fields = hb.read_text(errors="replace").split()
            if len(fields) >= 2 and fields[0] == current.task_id:
                with contextlib.suppress(ValueError):
                    current.last_alive = float(fields[1])
            current.last_alive = max(current.last_alive, current.start)
    return bodies


def bound_deaths(bodies: list[Body], kills: Kills, watcher: ExitWatcher) -> None:
    for body in bodies:
        if body.end is not None:
            continue
        exact = [t for t in kills.by_pid.get(body.pid, []) if t >= body.start]
        exact += [t for t in kills.by_pgid.get(body.pgid, []) if t >= body.start]
        watched = watcher.exits.get(body.pid)
        if exact and (watched is None or min(exact) <= watched):
            body.death, body.death_exact = min(exact), True
        elif watched is not None:
            body.death = watched


@dataclass
class Overlap:
    key: str
    at: float
    bodies: list[Body]
    definite: bool


def overlaps(bodies: list[Body], limits: dict[str, int]) -> tuple[dict[str, int], list[Overlap]]:
    """Peak bodies per key at any instant, and each moment a key went over its K (end_hi: misses nothing);
    ``definite`` when it is over K with killed bodies ending at their lower bound too."""
    by_key: dict[str, list[Body]] = collections.defaultdict(list)
    for b in bodies:
        by_key[b.key].append(b)
    peaks: dict[str, int] = {}
    found: list[Overlap] = []
    for key, group in by_key.items():
        limit = limits.get(key, 1)
        events = sorted(
            [(b.start, 1, i) for i, b in enumerate(group)] + [(b.end_hi, -1, i) for i, b in enumerate(group)],
            key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
        )
        active: set[int] = set()
        peak = 0
        for t, delta, i in events:
            if delta < 0:
                active.discard(i)
                continue
            active.add(i)
            peak = max(peak, len(active))
            if len(active) > limit:
                members = [group[j] for j in sorted(active, key=lambda j: group[j].start)]
                definite = sum(1 for b in members if b.end_lo > t or b is group[i]) > limit
                found.append(Overlap(key, t, members, definite))
        peaks[key] = peak
    return peaks, found


def writer_overlaps(bodies: list[Body], writers: set[str]) -> list[Overlap]:
    """Each pair of bodies of one key, one of them a writer (task id in ``writers``), that ran at the same instant
    (end_hi: misses nothing); ``definite`` when they overlap with killed bodies ending at their lower bound too."""
    by_key: dict[str, list[Body]] = collections.defaultdict(list)
    for b in bodies:
        by_key[b.key].append(b)
    found: list[Overlap] = []
    for key, group in by_key.items():
        group = sorted(group, key=lambda b: b.start)
        for i, a in enumerate(group):
            for b in group[i + 1 :]:
                if b.start >= a.end_hi:
                    break  # sorted by start: every later body starts after ``a`` ended too
                if a.task_id in writers or b.task_id in writers:
                    found.append(Overlap(key, b.start, [a, b], b.start < a.end_lo))
    return found


# ----------------------------------------------------------------------------------------------------------
# The run


@dataclass
class Report:
    config: Config
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    fault_log: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    logdir: Path | None = None

    def text(self) -> str:
        lines = [self.config.describe(), "faults as run (seconds from the first publish):"]
        lines += [f"  {line}" for line in self.fault_log]
        lines.append("figures:")
        lines += [f"  {k}: {v}" for k, v in self.figures.items()]
        if self.details:
            lines.append("details:")
            lines += [f"  {d}" for d in self.details]
        lines.append(f"logs: {self.logdir}")
        lines.append("verdict: " + ("OK" if not self.failures else "FAILED"))
        lines += [f"  - {f}" for f in self.failures]
        return "\n".join(lines)


class Chaos:
    def __init__(self, config: Config, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.observed = workdir / "observed"
        self.observed.mkdir(parents=True, exist_ok=True)
        self.logdir = workdir / "logs"
        self.logdir.mkdir(exist_ok=True)
        self.kills = Kills()
        self.report = Report(config, logdir=self.logdir)
        self.tasks: dict[str, tuple[str, float, int]] = {}  # task id -> (key, seconds, seq)
        self.cleanups: dict[str, float] = {}  # task id -> seconds its body cleans up for after SIGTERM
        self.time_limited: dict[str, float] = {}  # task id -> its hard time limit (shorter than its body)
        self.writers: set[str] = set()  # task ids published as chaos.write (exclusive); other doc:N tasks read
        self.config_version = 0  # the harness's keyed_config_version: above the workers' (0), which keep it
        self.sharded_rejections: set[str] = set()  # writers rejected at arrival: the name was sharded then
        self.published_at: dict[str, float] = {}  # task id -> when its publish returned (monotonic)
        self.redis_stops: list[float] = []  # when each Redis restart / outage began (monotonic)
        self.main_kills: list[float] = []  # when a worker's main process was SIGKILLed (monotonic): mid-pop losses
        self.t0 = 0.0
        self.last_fault_end = 0.0
        self.drift: list[str] = []
        self.reconcile_errors = 0
        self.publish_retries = 0
        self._stop = threading.Event()
        self._errors: list[str] = []
        self.died: list[str] = []

    # -- helpers -------------------------------------------------------------------------------------------

    def rel(self, t: float | None = None) -> float:
        return (now() if t is None else t) - self.t0

    def log_fault(self, text: str) -> None:
        line = f"{self.rel():7.1f}s  {text}"
        self.report.fault_log.append(line)
        print(f"[chaos] {line}", flush=True)

    def running_bodies(self) -> list[Body]:
        """Bodies running now (start, no end, heartbeat fresh), from the observer's files."""
        t = now()
        return [b for b in read_bodies(self.observed) if b.end is None and t - b.last_alive < 0.25]

    # -- threads -------------------------------------------------------------------------------------------

    def _guard(self, fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException:
                self._errors.append(traceback.format_exc())

        return run

    def publish(self) -> None:
        cfg = self.config
        rng = random.Random(cfg.seed * 7919 + 1)
        spacing = cfg.submit_over / cfg.tasks
        for seq in range(cfg.tasks):
            if self._stop.is_set():
                return
            pick = rng.random()
            if pick < 0.2:
                key = GATE_KEY
            elif pick < 0.2 + cfg.doc_fraction:
                key = rng.choice(cfg.doc_key_names)
            else:
                key = f"m:{rng.randrange(cfg.mutex_keys)}"
            r = rng.random()
            if seq < 2:  # a body longer than the lease runs from the start (the first fault may need one)
                key, r = f"m:{seq}", 0.0
            if r < cfg.long_fraction:
                seconds = rng.uniform(cfg.lease + 0.5, cfg.lease + 3.0)
            elif r < cfg.long_fraction + 0.1:
                seconds = rng.uniform(0.3, 1.5)
            else:
                seconds = rng.uniform(0.02, 0.3)
            task_id = f"c{seq:05d}-{uuid.UUID(int=rng.getrandbits(128)).hex[:12]}"
            options: dict[str, Any] = {}
            kwargs: dict[str, Any] = {}
            if rng.random() < cfg.cleanup_fraction:
                kwargs["cleanup"] = self.cleanups[task_id] = round(rng.uniform(0.2, 1.5), 3)
            if seq >= 2 and rng.random() < cfg.time_limit_fraction:
                # billiard fails the job at the limit, then SIGTERM, SIGKILL 0.1 s later: the cleanup is cut short
                seconds = rng.uniform(0.6, 1.5)
                options["time_limit"] = self.time_limited[task_id] = round(seconds / 2, 2)
                kwargs["cleanup"] = self.cleanups[task_id] = 1.0
            if key.startswith(f"{DOC_NAME}:") and rng.random() < cfg.writer_fraction:
                self.writers.add(task_id)
            self.tasks[task_id] = (key, round(seconds, 3), seq)
            while not self._stop.is_set():
                try:
                    self.task_for(task_id).apply_async(
                        (key, round(seconds, 3), seq), kwargs, task_id=task_id, **options
                    )
                    self.published_at[task_id] = now()
                    break
                except Exception:  # broker down: publish the same task id again (a duplicate is normal input)
                    self.publish_retries += 1
                    time.sleep(0.5)
            delay = self.t0 + (seq + 1) * spacing - now()
            if delay > 0:
                time.sleep(delay)

    def reconcile_loop(self) -> None:
        from celery_keyed.beat import reconcile

        while not self._stop.wait(3.0):
            try:
                summary = reconcile(self.ns.app)
                self.drift += summary["drift"]
            except Exception:
                self.reconcile_errors += 1

    def watch_restore_mutex(self) -> None:
        """kombu's Redis transport restores unacked messages past the visibility timeout under one lock
        (``unacked_mutex``, held for milliseconds); a holder that dies or loses Redis inside leaves it for its
        whole expiry. Logged when seen held for more than 2 s: no message is redelivered meanwhile."""
        import redis as redis_lib

        client = redis_lib.Redis.from_url(self.redis.url_for(0), socket_timeout=1.0)
        held_since: float | None = None
        reported = False
        while not self._stop.wait(0.5):
            try:
                ttl = client.pttl("unacked_mutex")
            except Exception:
                continue
            if ttl is None or ttl < 0:
                held_since, reported = None, False
                continue
            held_since = held_since or now()
            if not reported and now() - held_since > 2.0:
                reported = True
                self.log_fault(f"  Redis restore lock (unacked_mutex) held for 2 s, {ttl / 1000:.0f} s to expiry")
        client.close()

    def run_faults(self) -> None:
        for fault in self.config.faults:
            delay = self.t0 + fault.at - now()
            if delay > 0 and self._stop.wait(delay):
                return
            getattr(self, f"fault_{fault.kind}")(fault)
            self.last_fault_end = now()

    # -- faults --------------------------------------------------------------------------------------------

    def _restart_worker(self, name: str, pause: float) -> None:
        time.sleep(pause)
        self.workers.start(name)
        ok = self.workers.wait_ready(name)
        self.log_fault(f"  {name} started again (ready={ok})")

    def fault_kill_main(self, fault: Fault) -> None:
        name = fault.target or WORKERS[0]
        proc = self.workers.procs[name]
        self.workers.expected_exit.add(proc.pid)
        busy = [b.task_id for b in self.running_bodies() if b.pgid == proc.pid]
        children = self.workers.children(name)
        self.main_kills.append(now())
        self.kills.kill(proc.pid)
        proc.wait()
        time.sleep(0.3)
        alive = [pid for pid in children if psutil.pid_exists(pid)]
        self.log_fault(
            f"SIGKILL main of {name} pid {proc.pid} (bodies running: {busy}; pool children {children}, "
            f"alive 0.3 s later: {alive})"
        )
        self._restart_worker(name, fault.duration)

    def fault_kill_child(self, fault: Fault) -> None:
        name = fault.target or WORKERS[0]
        children = set(self.workers.children(name))
        busy = [b for b in self.running_bodies() if b.pid in children]
        if not busy:  # some other worker's busy child, else any child
            busy = [b for b in self.running_bodies() if b.worker in WORKERS]
        if busy:
            body = random.Random(self.config.seed + int(fault.at)).choice(busy)
            self.kills.kill(body.pid)
            self.log_fault(f"SIGKILL pool child {body.pid} of {body.worker} running {body.task_id} ({body.key})")
        elif children:
            pid = sorted(children)[0]
            self.kills.kill(pid)
            self.log_fault(f"SIGKILL idle pool child {pid} of {name}")

    def fault_warm_shutdown(self, fault: Fault) -> None:
        deadline = now() + 15.0
        long_body: Body | None = None
        while now() < deadline and long_body is None:
            for b in self.running_bodies():
                if self.tasks.get(b.task_id, ("", 0.0, 0))[1] > self.config.lease and b.worker in self.workers.procs:
                    long_body = b
                    break
            else:
                time.sleep(0.1)
        name = long_body.worker if long_body is not None else (fault.target or WORKERS[0])
        proc = self.workers.procs[name]
        self.workers.expected_exit.add(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        what = (
            f"mid {long_body.task_id} ({long_body.key}, {self.tasks[long_body.task_id][1]}s > lease)"
            if long_body
            else "no body longer than the lease was running"
        )
        self.log_fault(f"SIGTERM (warm shutdown) {name} pid {proc.pid} {what}")
        if long_body is not None:  # a task of the same key waits: an admission while the body runs is a breach
            self.probe(long_body.key)
        try:
            proc.wait(timeout=60)
            self.log_fault(f"  {name} exited {proc.returncode}")
        except subprocess.TimeoutExpired:
            self.report.failures.append(f"warm shutdown of {name} did not end within 60 s")
            self.kills.killpg(proc.pid)
            proc.wait()
        self._restart_worker(name, fault.duration)

    def fault_cold_shutdown(self, fault: Fault) -> None:
        """SIGQUIT to a worker's main process while a body that handles SIGTERM with a cleanup runs there: Celery
        cancels the running tasks (SIGTERM to their pool processes) and waits for its pool; the cleanup runs on
        (a task of its key published meanwhile must not start before it ends); the cancelled tasks come back."""
        deadline = now() + 15.0
        chosen: Body | None = None
        while now() < deadline and chosen is None:
            for b in self.running_bodies():
                if self.cleanups.get(b.task_id, 0.0) > 0 and b.worker in self.workers.procs:
                    chosen = b
                    break
            else:
                time.sleep(0.1)
        name = chosen.worker if chosen is not None else (fault.target or WORKERS[0])
        proc = self.workers.procs[name]
        self.workers.expected_exit.add(proc.pid)
        os.kill(proc.pid, signal.SIGQUIT)
        what = (
            f"mid {chosen.task_id} ({chosen.key}, cleanup {self.cleanups[chosen.task_id]}s on SIGTERM)"
            if chosen is not None
            else "no body with a cleanup was running"
        )
        self.log_fault(f"SIGQUIT (cold shutdown) {name} pid {proc.pid} {what}")
        if chosen is not None:
            self.probe(chosen.key)
        try:
            proc.wait(timeout=60)
            self.log_fault(f"  {name} exited {proc.returncode}")
        except subprocess.TimeoutExpired:
            self.report.failures.append(f"cold shutdown of {name} did not end within 60 s")
            self.kills.killpg(proc.pid)
            proc.wait()
        self._restart_worker(name, fault.duration)

    def task_for(self, task_id: str) -> Any:
        """The task a task id is published as: chaos.write for a writer, chaos.read for another doc:N task."""
        if task_id in self.writers:
            return self.ns.write
        return self.ns.read if self.tasks[task_id][0].startswith(f"{DOC_NAME}:") else self.ns.work

    def probe(self, key: str, n: int = 2, seconds: float = 0.05, writers: Iterable[int] = ()) -> list[str]:
        """Publish ``n`` short tasks of ``key`` now (counted like every other task); those at positions ``writers``
        (a doc:N key) as writers."""
        published = []
        writers = set(writers)
        for i in range(n):
            task_id = f"p{len(self.tasks):05d}-{uuid.uuid4().hex[:12]}"
            self.tasks[task_id] = (key, seconds, 100000 + len(self.tasks))
            if i in writers:
                self.writers.add(task_id)
            with contextlib.suppress(Exception):
                self.task_for(task_id).apply_async((key, seconds, self.tasks[task_id][2]), task_id=task_id)
                self.published_at[task_id] = now()
            published.append(task_id)
        what = f" ({len(writers)} writers)" if writers else ""
        self.log_fault(f"  published {n} probe tasks of {key}{what}")
        return published

    def fault_reshard(self, fault: Fault) -> None:
        """Change the shard count of the readers' and writers' name while they run (1 -> 2 -> 4 -> 1, 1 -> 4 -> 2 -> 1,
        ...: up and down), as a deploy would, and lower its limit by an operator override meanwhile. Before each step,
        a burst of readers with a writer among them on one doc key, so the change meets readers running, a writer
        running or waiting, and readers in line behind it. The configuration is stored with a version above the
        workers' (docs/upgrading.md): a worker that starts again keeps it. The observer checks that no writer
        ran beside anything of its key and that at most K readers ran at once."""
        import celery_keyed
        from celery_keyed.access import dispatch
        from celery_keyed.ledger import Ledger, NameConfig

        cfg = self.config
        rng = random.Random(cfg.seed * 104729 + int(fault.at * 10))
        path = rng.choice(RESHARD_PATHS)
        key = rng.choice(cfg.doc_key_names)
        ledger = Ledger(self.engine, lease=cfg.lease)  # the harness's own engine: the observer never shares the app's
        self.log_fault(
            f"reshard {DOC_NAME}: shards 1 -> {' -> '.join(map(str, path))}, limit {cfg.doc_limit} -> "
            f"{RESHARD_LOWERED} -> {cfg.doc_limit}, around a burst on {key}"
        )
        for step, shards in enumerate(path):
            self.probe(key, n=6, seconds=round(rng.uniform(0.2, 0.8), 2), writers=[rng.randrange(0, 4)])
            time.sleep(RESHARD_SETTLE)
            running = [
                (b.task_id, b.key, "w" if b.task_id in self.writers else "r")
                for b in self.running_bodies()
                if b.key.startswith(f"{DOC_NAME}:")
            ]
            last = step == len(path) - 1
            deadline = now() + (60.0 if last else 0.0)  # the last step (shards 1, no override) must happen
            while True:
                self.config_version += 1
                try:
                    promotions = ledger.configure(
                        {DOC_NAME: NameConfig(DOC_NAME, limit=cfg.doc_limit, shards=shards)},
                        version=self.config_version,
                    )
                    dispatch(self.ns.app, promotions)  # the one dispatch (and broker-error policy) users get
                    if step == 0:
                        celery_keyed.set_limit(self.ns.app, DOC_NAME, RESHARD_LOWERED, reason="chaos reshard")
                    if last:
                        celery_keyed.clear_limit(self.ns.app, DOC_NAME, reason="chaos reshard")
                    break
                except Exception as error:  # the ledger is down (no other fault runs meanwhile, but a restart ends)
                    self.log_fault(f"  reshard step failed: {error!r}")
                    if now() >= deadline:
                        break
                    time.sleep(1.0)
            self.log_fault(
                f"  {DOC_NAME} shards={shards} (config version {self.config_version})"
                + (f", limit override {RESHARD_LOWERED}" if step == 0 else "")
                + (", override cleared" if last else "")
                + f"; doc bodies running: {running}"
            )
            time.sleep(fault.duration)

    def fault_pg_restart(self, fault: Fault) -> None:
        self.log_fault("PostgreSQL restart")
        self.pg.restart()
        self.log_fault("  PostgreSQL up")

    def fault_pg_outage(self, fault: Fault) -> None:
        self.log_fault(f"PostgreSQL down for {fault.duration}s")
        self.pg.suspend()
        time.sleep(fault.duration)
        self.pg.resume()
        self.log_fault("  PostgreSQL up")

    def fault_pg_partition_outage(self, fault: Fault) -> None:
        """A silent network between one worker and PostgreSQL for longer than a lease: its renewals hang without an
        error; its self-fence must stop its keyed bodies before their leases could be reclaimed elsewhere (the
        observer checks the bound), and the bodies it stopped run again."""
        busy = [b.task_id for b in self.running_bodies() if b.worker == PARTITIONED]
        self.log_fault(f"PostgreSQL silent for {PARTITIONED} for {fault.duration}s (bodies running there: {busy})")
        self.proxy.silence()
        time.sleep(fault.duration)
        self.proxy.heal()
        self.log_fault(f"  {PARTITIONED} reaches PostgreSQL again")

    def fault_redis_restart(self, fault: Fault) -> None:
        self.log_fault("Redis restart")
        self.redis_stops.append(now())
        self.redis.restart()
        self.log_fault("  Redis up")

    def fault_redis_outage(self, fault: Fault) -> None:
        self.log_fault(f"Redis down for {fault.duration}s")
        self.redis_stops.append(now())
        self.redis.suspend()
        time.sleep(fault.duration)
        self.redis.resume()
        self.log_fault("  Redis up")

    # -- setup, drain, checks ------------------------------------------------------------------------------

    def run(self) -> Report:
        cfg = self.config
        print(f"[chaos] {cfg.describe()}", flush=True)
        pg = start_postgres(use_env=False)
        redis = start_redis(use_env=False, persistent=True)
        assert isinstance(pg, PostgresServer) and isinstance(redis, RedisServer)
        self.pg, self.redis = pg, redis
        try:
            return self._run()
        finally:
            # The publisher's AsyncResults unsubscribe from their result channels when collected: collect them
            # while Redis still runs. Collected after it stopped, each retried for 20 s and raised in whatever test
            # ran next in this process (CI: an error at the setup of the wheel test).
            gc.collect()
            ns = getattr(self, "ns", None)
            if ns is not None:
                with contextlib.suppress(Exception):
                    ns.app.close()
            proxy = getattr(self, "proxy", None)
            if proxy is not None:
                proxy.stop()
            pg.stop()
            redis.stop()

    def _run(self) -> Report:
        from celery_keyed.ledger import migrate

        cfg = self.config
        engine = sa.create_engine(self.pg.url, pool_pre_ping=True)
        migrate(engine)
        self.engine = engine
        env = dict(os.environ)
        env.update(
            KEYED_DATABASE_URL=self.pg.url,
            CELERY_BROKER_URL=self.redis.url_for(0),
            CELERY_RESULT_BACKEND=self.redis.url_for(1),
            KEYED_LIMITS=json.dumps({"gate": cfg.gate_limit, DOC_NAME: cfg.doc_limit}),
            KEYED_LEASE=str(cfg.lease),
            VISIBILITY_TIMEOUT=str(cfg.visibility_timeout),
            CHAOS_OBSERVED=str(self.observed),
            PYTHONPATH=str(ROOT),
            PYTHONWARNINGS="ignore",
        )
        from tests.chaos.proj import make_app

        self.ns = make_app(env)
        self.workers = Workers(env, self.logdir, cfg.concurrency)
        self.proxy = SilentProxy("127.0.0.1", self.pg.port, lifetime=3600.0).start()
        self.workers.env_of[PARTITIONED] = {"KEYED_DATABASE_URL": self.proxy.url_for(self.pg.url)}
        watcher = ExitWatcher(self.observed)
        watcher.start()
        threads: list[threading.Thread] = []
        try:
            for name in WORKERS:
                self.workers.start(name)
            for name in WORKERS:
                if not self.workers.wait_ready(name):
                    raise RuntimeError(f"worker {name} did not start: {self.workers.procs[name].log}")  # type: ignore[attr-defined]
            self.t0 = now()
            threads = [
                threading.Thread(target=self._guard(fn), name=f"chaos-{fn.__name__}", daemon=True)
                for fn in (self.publish, self.run_faults)
            ]
            reconciler = threading.Thread(target=self._guard(self.reconcile_loop), daemon=True)
            threading.Thread(target=self._guard(self.watch_restore_mutex), daemon=True).start()
            supervisor = threading.Thread(
                target=self._guard(lambda: self.workers.supervise(self.died, self._stop, self.rel)), daemon=True
            )
            for t in [*threads, reconciler, supervisor]:
                t.start()
            for t in threads:
                t.join()
            self.report.figures["publishing took"] = f"{cfg.submit_over:.1f}s (planned)"
            faults_done = self.rel(self.last_fault_end)
            drained_at = self.drain()
            self._stop.set()
            reconciler.join(10)
            supervisor.join(10)
            self.final_reconcile()
            self.report.figures["publish retries (broker down)"] = self.publish_retries
            self.report.figures["last fault ended at"] = f"{faults_done:.1f}s"
            if drained_at is not None:
                self.report.figures["last fault -> drained"] = f"{drained_at - self.last_fault_end:.1f}s"
            deaths = self.workers.unexpected_deaths()
        finally:
            self._stop.set()
            self.workers.stop_all(self.kills)
            watcher.stop()
        deaths = self.died + deaths
        self.report.figures["workers that died by themselves (restarted)"] = len(self.died)
        if deaths:
            self.report.failures.append(f"workers died that the harness did not kill: {deaths}")
        self.check(watcher)
        for err in self._errors:
            self.report.failures.append(f"harness thread error: {err}")
        from celery_keyed.publisher import close_publisher

        close_publisher(self.ns.app)
        self.ns.app.close()
        engine.dispose()
        return self.report

    def _state(self) -> dict[str, Any]:
        ids = list(self.tasks)
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT task_id, outcome FROM keyed_tasks WHERE task_id = ANY(:ids)"), {"ids": ids}
            ).all()
            claims = conn.execute(sa.text("SELECT count(*) FROM keyed_claims")).scalar_one()
            waiting = conn.execute(sa.text("SELECT count(*) FROM keyed_waiting")).scalar_one()
        outcomes = {r.task_id: r.outcome for r in rows}
        return {"outcomes": outcomes, "claims": claims, "waiting": waiting, "results": self.results(ids)}

    def results(self, ids: list[str]) -> dict[str, tuple[str, Any]]:
        backend = self.ns.app.backend
        client = backend.client
        found: dict[str, tuple[str, Any]] = {}
        for i in range(0, len(ids), 500):
            chunk = ids[i : i + 500]
            for task_id, raw in zip(chunk, client.mget([backend.get_key_for_task(t) for t in chunk]), strict=True):
                if raw is not None:
                    meta = backend.decode_result(raw)
                    found[task_id] = (meta["status"], meta["result"])
        return found

    def broker_lost(self, seen: Iterable[str]) -> list[str]:
        """Task ids the Redis transport lost before any worker received them: published cleanly before a Redis
        stop or a worker's main process SIGKILL, never in the ledger, never logged as received by a worker. kombu
        pops a message and records it as unacked in a second step; a connection that drops in between (Redis
        restarting, a worker killed mid-pop) loses it (plain Celery too: tests/chaos/repro_redis_loss.py,
        tests/acceptance/midpop.py; docs/features.md, the outbox). Everything else missing is a
        failure."""
        seen = set(seen)
        unseen = [
            t
            for t in self.tasks
            if t not in seen
            and t in self.published_at
            and any(stop >= self.published_at[t] - 0.5 for stop in self.redis_stops + self.main_kills)
        ]
        if not unseen:
            return []
        logs = "".join(p.read_text(errors="replace") for p in sorted(self.logdir.glob("*.log")))
        return [t for t in unseen if t not in logs]

    def drain(self) -> float | None:
        deadline = now() + self.config.drain_timeout
        state: dict[str, Any] = {}
        lost_since: tuple[frozenset[str], float] | None = None
        while now() < deadline:
            try:
                state = self._state()
            except Exception:
                time.sleep(0.5)
                continue
            done = sum(1 for o in state["outcomes"].values() if o is not None)
            quiet = state["claims"] == 0 and state["waiting"] == 0
            if done == len(self.tasks) and len(state["results"]) == len(self.tasks) and quiet:
                return now()
            # Only broker-lost ids missing, for three visibility timeouts (a redelivery would have come by then)
            lost = frozenset(self.broker_lost(state["outcomes"]))
            if lost and quiet and done + len(lost) == len(self.tasks) and len(state["results"]) == done:
                if lost_since is None or lost_since[0] != lost:
                    lost_since = (lost, now())
                elif now() - lost_since[1] >= 3 * self.config.visibility_timeout:
                    return lost_since[1]
            else:
                lost_since = None
            time.sleep(0.5)
        self.report.failures.append(
            f"not drained {self.config.drain_timeout:.0f}s after the last publish/fault: "
            f"{sum(1 for o in state.get('outcomes', {}).values() if o is not None)}/{len(self.tasks)} booked, "
            f"{len(state.get('results', {}))} results, {state.get('claims')} claims, {state.get('waiting')} waiting"
        )
        return None

    def final_reconcile(self) -> None:
        from celery_keyed.ledger.reconcile import check_counters_once

        try:
            self.drift += check_counters_once(self.engine)
        except Exception as error:
            self.report.failures.append(f"final counter check failed: {error!r}")

    def check(self, watcher: ExitWatcher) -> None:
        cfg, figures, failures = self.config, self.report.figures, self.report.failures
        bodies = read_bodies(self.observed)
        bound_deaths(bodies, self.kills, watcher)
        limits = {GATE_KEY: cfg.gate_limit}
        docs = set(cfg.doc_key_names)
        peaks, found = overlaps([b for b in bodies if b.key not in docs], limits)
        # Readers and writers: the readers of a doc key at most K at once (K as configured: the reshard fault only
        # lowers it for a while), and no writer beside any other body of its key.
        readers = [b for b in bodies if b.key in docs and b.task_id not in self.writers]
        reader_peaks, reader_found = overlaps(readers, dict.fromkeys(docs, cfg.doc_limit))
        beside = writer_overlaps([b for b in bodies if b.key in docs], self.writers)
        killed = [b for b in bodies if b.end is None]
        figures["tasks published"] = len(self.tasks)
        figures["bodies started / ended / killed"] = f"{len(bodies)} / {len(bodies) - len(killed)} / {len(killed)}"
        figures["killed bodies bounded by a harness kill / exit watcher / heartbeat only"] = (
            f"{sum(1 for b in killed if b.death_exact)} / "
            f"{sum(1 for b in killed if b.death is not None and not b.death_exact)} / "
            f"{sum(1 for b in killed if b.death is None)}"
        )
        mutex_peak = max((p for k, p in peaks.items() if k != GATE_KEY), default=0)
        figures["peak bodies per mutex key (K=1)"] = mutex_peak
        figures[f"peak bodies of {GATE_KEY} (K={cfg.gate_limit})"] = peaks.get(GATE_KEY, 0)
        definite = [o for o in found if o.definite]
        figures["over-admissions (definite / ambiguous)"] = f"{len(definite)} / {len(found) - len(definite)}"
        if definite:
            failures.append(f"bound broken: {len(definite)} moments with more than K bodies of a key running")
        doc_bodies = [b for b in bodies if b.key in docs]
        figures[f"{DOC_NAME} bodies: readers / writers"] = (
            f"{sum(1 for b in doc_bodies if b.task_id not in self.writers)} / "
            f"{sum(1 for b in doc_bodies if b.task_id in self.writers)}"
        )
        figures[f"peak readers per {DOC_NAME} key (K={cfg.doc_limit})"] = max(reader_peaks.values(), default=0)
        reader_definite = [o for o in reader_found if o.definite]
        figures["reader over-admissions (definite / ambiguous)"] = (
            f"{len(reader_definite)} / {len(reader_found) - len(reader_definite)}"
        )
        if reader_definite:
            failures.append(
                f"readers' bound broken: {len(reader_definite)} moments with more than K readers of a key running"
            )
        writer_definite = [o for o in beside if o.definite]
        figures["writer overlaps (definite / ambiguous)"] = (
            f"{len(writer_definite)} / {len(beside) - len(writer_definite)}"
        )
        if writer_definite:
            failures.append(
                f"writers' bound broken: {len(writer_definite)} times a writer ran beside a body of its key"
            )
        for label, overlaps_found in (
            ("OVER-ADMISSION", found),
            ("READERS OVER K", reader_found),
            ("WRITER BESIDE", beside),
        ):
            for o in overlaps_found[:20]:
                self.report.details.append(
                    f"{label if o.definite else 'ambiguous ' + label.lower()} {o.key} at {self.rel(o.at):.2f}s: "
                    + "; ".join(
                        f"{'writer ' if b.task_id in self.writers else ''}"
                        f"{b.task_id} on {b.worker} pid {b.pid} {self.rel(b.start):.2f}-{self.rel(b.end_hi):.2f}s"
                        + ("" if b.end is not None else " (killed" + (", exact)" if b.death_exact else ")"))
                        for b in o.bodies
                    )
                )
        per_task = collections.Counter(b.task_id for b in bodies)
        completed_bodies = collections.Counter(b.task_id for b in bodies if b.end is not None and not b.cleaned_up)
        figures["bodies stopped by SIGTERM that cleaned up / tasks with a hard time limit"] = (
            f"{sum(1 for b in bodies if b.cleaned_up)} / {len(self.time_limited)}"
        )
        figures["task ids run more than once / completed more than once"] = (
            f"{sum(1 for n in per_task.values() if n > 1)} / {sum(1 for n in completed_bodies.values() if n > 1)}"
        )
        never = [t for t in self.tasks if t not in per_task]
        state = self._state_after()
        if state is None:
            failures.append("could not read the ledger after the run")
            return
        outcomes, results = state["outcomes"], state["results"]
        self.sharded_rejections -= set(per_task)  # only a writer that never ran is excused
        figures[f"writers rejected at arrival while {DOC_NAME} was sharded (docs: Readers and writers)"] = len(
            self.sharded_rejections
        )
        dist = collections.Counter(outcomes.get(t, "missing") or "open" for t in self.tasks)
        figures["books (outcome of each task id)"] = dict(dist)
        books = state["books"]
        figures["Ledger.books()"] = books
        figures["claims / waiting rows left"] = f"{state['claims']} / {state['waiting']}"
        lost = set(self.broker_lost(outcomes)) - {b.task_id for b in bodies}
        figures["lost by the Redis transport before any worker received them (docs/guarantees.md: not guaranteed)"] = (
            f"{len(lost)} {sorted(lost)[:5]}" if lost else 0
        )
        bad = {
            t: outcomes.get(t, "missing") or "open"
            for t in self.tasks
            if outcomes.get(t) != self.expected_outcome(t, outcomes.get(t)) and t not in lost
        }
        if bad:
            failures.append(f"{len(bad)} task ids not completed in the books: {_sample(bad)}")
        if books.get("open", 0) or state["claims"] or state["waiting"]:
            failures.append(
                f"open books after drain: {books.get('open', 0)} open, {state['claims']} claims, "
                f"{state['waiting']} waiting"
            )
        if books.get("arrivals", 0) != len(self.tasks) - len(lost):
            failures.append(f"books count {books.get('arrivals')} arrivals for {len(self.tasks)} published task ids")
        mismatched = {}
        for task_id, (_key, _seconds, seq) in self.tasks.items():
            if task_id in lost:
                continue
            status, value = results.get(task_id, ("missing", None))
            expected = "SUCCESS" if self.expected_outcome(task_id, outcomes.get(task_id)) == "completed" else "FAILURE"
            if status != expected or (status == "SUCCESS" and value != seq):
                mismatched[task_id] = f"{status} {value!r} (books: {outcomes.get(task_id)})"
        expected_results = len(self.tasks) - len(lost)
        figures["results matching the books"] = f"{expected_results - len(mismatched)}/{expected_results}"
        if mismatched:
            failures.append(f"{len(mismatched)} results do not match the books: {_sample(mismatched)}")
        ran_not_booked = [
            t
            for t in self.tasks
            if t in completed_bodies and outcomes.get(t) != self.expected_outcome(t, outcomes.get(t))
        ]
        if ran_not_booked:
            self.report.details.append(f"ran to the end but not completed in the books: {ran_not_booked[:10]}")
        if never:
            self.report.details.append(f"never started a body: {len(never)} task ids, e.g. {never[:10]}")
        for task_id in list(bad)[:5]:
            status, value = results.get(task_id, ("missing", None))
            runs = [b for b in bodies if b.task_id == task_id]
            self.report.details.append(
                f"{task_id} ({self.tasks[task_id][0]}): result {status} {str(value)[:160]!r}; bodies: "
                + "; ".join(
                    f"{b.worker} pid {b.pid} {self.rel(b.start):.2f}-{self.rel(b.end_hi):.2f}s"
                    + (" ended" if b.end is not None else " killed")
                    for b in runs
                )
                + f"; explain: {state['explain'].get(task_id)}"
                + f"; broker: {state['broker'].get(task_id)}"
            )
        if bad:
            self.report.details.append(f"broker: restore mutex ttl {state['broker'].get('unacked_mutex ttl ms')} ms")
        drift_events = state["drift_events"]
        figures["reconcile drift (runs / keyed_events)"] = f"{len(self.drift)} / {len(drift_events)}"
        figures["reconcile runs failed (ledger down)"] = self.reconcile_errors
        if self.drift or drift_events:
            failures.append(f"reconcile drift: {(self.drift + drift_events)[:10]}")
        figures["reclaimed leases (keyed_events)"] = state["reclaimed"]
        figures["worker log lines"] = self.scan_logs()
        figures["code under test"] = code_under_test()

    def expected_outcome(self, task_id: str, booked: str | None = None) -> str:
        """A body given a hard time limit shorter than itself fails (acks_on_timeout, Celery's default: acked, not
        run again) — unless it ran to its end before billiard killed its process (its worker's loop was held up,
        e.g. retrying the result backend through a Redis outage): then it stored SUCCESS and is booked completed.
        A writer that arrived while its name was sharded is rejected (docs/features.md "Readers and writers") when
        it never ran. Every other task completes, however often its body was stopped."""
        if task_id in self.time_limited and booked != "completed":
            return "failed"
        if task_id in self.sharded_rejections and booked == "rejected":
            return "rejected"
        return "completed"

    def _state_after(self) -> dict[str, Any] | None:
        from celery_keyed.ledger import Ledger

        try:
            state = self._state()
            ledger = Ledger(self.engine, lease=self.config.lease)
            state["books"] = ledger.books()
            with self.engine.connect() as conn:
                state["drift_events"] = [
                    f"{r.key}: {r.detail}"
                    for r in conn.execute(sa.text("SELECT key, detail FROM keyed_events WHERE kind = 'drift'"))
                ]
                state["reclaimed"] = conn.execute(
                    sa.text("SELECT count(*) FROM keyed_events WHERE kind = 'reclaimed'")
                ).scalar_one()
                rejected = conn.execute(
                    sa.text("SELECT task_id, detail FROM keyed_tasks WHERE outcome = 'rejected' AND task_id = ANY(:t)"),
                    {"t": sorted(self.writers)},
                ).all()
            self.sharded_rejections = {r.task_id for r in rejected if r.detail.endswith("the name is sharded")}
            outcomes = state["outcomes"]
            bad = [t for t in self.tasks if outcomes.get(t) != self.expected_outcome(t, outcomes.get(t))][:5]
            state["explain"] = {}
            state["broker"] = self.broker_state(bad)
            for t in bad:
                try:
                    state["explain"][t] = ledger.explain(t)
                except Exception as error:
                    state["explain"][t] = repr(error)
            return state
        except Exception:
            self.report.details.append(traceback.format_exc())
            return None

    def broker_state(self, task_ids: list[str]) -> dict[str, str]:
        """Where the Redis transport holds each of ``task_ids`` after the drain: in the unacked hash (with the
        age of its delivery and its tag), in a queue list, or nowhere; plus the restore mutex's remaining TTL.
        Tells a message the transport still holds but never restored from one that was acked or lost."""
        import redis as redis_lib

        found: dict[str, str] = {}
        try:
            client = redis_lib.Redis.from_url(self.redis.url_for(0))
            ages = dict(client.zrange("unacked_index", 0, -1, withscores=True))
            for tag, raw in client.hgetall("unacked").items():
                for t in task_ids:
                    if t.encode() in raw:
                        age = time.time() - ages[tag] if tag in ages else float("nan")
                        found[t] = f"unacked (tag {tag.decode()}, delivered {age:.1f}s ago)"
            for queue in client.keys("*"):
                if client.type(queue) != b"list":
                    continue
                for raw in client.lrange(queue, 0, -1):
                    for t in task_ids:
                        if t.encode() in raw:
                            found[t] = f"queued in {queue.decode()}"
            ttl = client.pttl("unacked_mutex")
            found["unacked_mutex ttl ms"] = str(ttl)
            client.close()
        except Exception as error:
            found["error"] = repr(error)
        for t in task_ids:
            found.setdefault(t, "nowhere in Redis (acked, or lost)")
        return found

    def scan_logs(self) -> dict[str, int]:
        patterns = {
            "Unrecoverable error": "Unrecoverable error",
            "Traceback": "Traceback",
            "drift": "drift",
            "reclaimed the slot": "reclaimed the slot",
            "self-fence (terminating)": "terminating",
            "WorkerLostError": "WorkerLostError",
            "ledger unreachable": "the ledger is unreachable",
        }
        counts = dict.fromkeys(patterns, 0)
        for log in self.workers.logs:
            text = log.read_text(errors="replace") if log.exists() else ""
            for label, pattern in patterns.items():
                counts[label] += text.count(pattern)
        return counts


def code_under_test() -> str:
    """HEAD, and a digest of the gate's files when they differ from it (the workers run the working tree)."""
    import hashlib

    def git(*args: str) -> str:
        result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return result.stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    changed = git("diff", "--name-only", "HEAD", "--", "celery_keyed").split()
    changed += git("ls-files", "--others", "--exclude-standard", "--", "celery_keyed").split()
    if not changed:
        return f"{head} (clean)"
    digest = hashlib.sha256(git("diff", "HEAD", "--", "celery_keyed").encode()).hexdigest()[:10]
    files = " ".join(changed)
    return f"{head} + uncommitted changes to {files} (diff {digest})"


def _sample(mapping: dict[str, Any], n: int = 8) -> str:
    items = list(mapping.items())
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return ", ".join(f"{k}: {v}" for k, v in items[:n]) + more


def run(config: Config, workdir: Path | None = None) -> Report:
    workdir = workdir or Path(tempfile.mkdtemp(prefix="celery-keyed-chaos-"))
    report = Chaos(config, workdir).run()
    print(report.text(), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--long", action="store_true", help="the make chaos variant (default: the short one)")
    parser.add_argument("--tasks", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    config = long_config(seed) if args.long else short_config(seed)
    if args.tasks:
        config.tasks = args.tasks
    report = run(config, args.workdir)
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
