"""Releases held until a pool process has exited: a slot goes back only once its body has provably stopped (D17).

A hard time limit reports the job's failure before the body has stopped: billiard fails the job (Celery's
``on_failure`` and ``on_timeout``, where the gate releases) and only then sends the pool process SIGTERM, and SIGKILL
0.1 s later if it is still there. A body that handles SIGTERM runs on meanwhile, and a release at the failure let the
next task of its key start beside it. So the release of such an attempt is held here until the pool has reaped that
process — billiard collected its exit status (``Popen.returncode``), or the process no longer exists at all — and
then runs. (A cancel — cold shutdown, connection loss — and a terminate need nothing of this: billiard reports their
jobs only when the process has exited, as ``Terminated``, or when the body has returned its result.)

The watch has a thread of its own, started when a release is held and ended when none is left, so it works whatever
the consumer loop does: Celery joins the pool outside the loop in a warm or cold shutdown. A held attempt keeps its
claim in the gate's running table, so the heartbeat renews its lease meanwhile; if the worker's main process ends
first (killed), the claim stays until its lease lapses and the reaper frees it — later, never early.

Threads and fields: ``_held`` (pid -> ``Held``) is written by the threads that hold (the outcome hooks, on the
consumer loop or billiard's threads) and by the watch thread, under ``_lock``; ``_thread`` under ``_lock`` too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("celery_keyed")

#: Seconds between two looks of the watch thread at the processes it waits for.
WATCH_INTERVAL = 0.005


@dataclass
class Held:
    """The releases waiting for one pool process to exit."""

    pid: int
    process: Any  # billiard's Process of that pid when the pool listed it, else None (watched by its pid alone)
    releases: list[Callable[[], None]] = field(default_factory=list)
    since: float = 0.0  # monotonic


@dataclass
class WatchReport:
    """What one ``watch_once`` did: releases run, and processes still waited for."""

    released: int = 0
    waiting: int = 0


def pool_processes(consumer: Any) -> list[Any]:
    """The prefork pool's processes (billiard ``Process`` objects) of a Celery consumer; empty on the other pools."""
    pool = getattr(getattr(consumer, "pool", None), "_pool", None)
    return list(getattr(pool, "_pool", None) or ())


def has_exited(pid: int, process: Any) -> bool:
    """Whether the pool process ``pid`` has provably exited: billiard has reaped it (its exit status is known), no
    process of that pid exists any more, or (Linux) it is a zombie — it has exited and runs nothing, but billiard has
    not collected it yet (it does so when it next maintains the pool, which after a SIGKILL took seconds). A pid
    reused by another process counts as running: that only holds a slot longer."""
    popen = getattr(process, "_popen", None)
    if popen is not None and getattr(popen, "returncode", None) is not None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # the pid belongs to someone else now: it was reaped, but we cannot be sure; wait on
        return False
    return _zombie(pid)


def _zombie(pid: int) -> bool:
    """Linux: the process has exited and waits to be reaped (state Z, or X while it is being reaped). A pid cannot be
    reused before its zombie is reaped, so this is the process we were asked about. False where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


class ExitWatch:
    """Runs releases once the pool process that ran their body has exited. ``watch_once`` looks once, in the caller's
    thread (tests); the thread runs while a release is held."""

    def __init__(self, processes: Callable[[], Iterable[Any]], *, interval: float = WATCH_INTERVAL) -> None:
        self.processes = processes
        self.interval = interval
        self._held: dict[int, Held] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def hold(self, pid: int | None, release: Callable[[], None]) -> bool:
        """Any thread: hold ``release`` until the pool process ``pid`` has exited. False (``release`` not taken) when
        there is nothing to wait for: the process has exited already, or it is no pool process of its own (no pid, or
        this very process, as on the solo and threads pools) — the caller releases at once."""
        if not pid or pid == os.getpid():
            return False
        process = next((p for p in self.processes() if getattr(p, "pid", None) == pid), None)
        if has_exited(pid, process):
            return False
        with self._lock:
            held = self._held.get(pid)
            if held is None:
                held = self._held[pid] = Held(pid, process, since=time.monotonic())
            held.releases.append(release)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="keyed-exit-watch", daemon=True)
                self._thread.start()
        logger.info("celery-keyed: a release waits for pool process %d to exit", pid)
        return True

    def waiting(self) -> int:
        """How many pool processes a held release waits for."""
        with self._lock:
            return len(self._held)

    def watch_once(self) -> WatchReport:
        """Run the releases whose process has exited (in the order they were held); report what is left."""
        with self._lock:
            candidates = list(self._held.values())
        gone = [held for held in candidates if has_exited(held.pid, held.process)]
        with self._lock:  # each runs once: in the thread that takes it off (the watch thread, or worker_shutdown's)
            gone = [held for held in gone if self._held.get(held.pid) is held and self._held.pop(held.pid)]
            waiting = len(self._held)
        released = 0
        for held in gone:
            logger.info(
                "celery-keyed: pool process %d exited (%.3f s after its job's end was reported); releasing",
                held.pid,
                time.monotonic() - held.since,
            )
            for release in held.releases:
                released += 1
                try:
                    release()
                except Exception:
                    logger.exception("celery-keyed: a release held for pool process %d failed", held.pid)
        return WatchReport(released=released, waiting=waiting)

    def _run(self) -> None:
        """The watch thread: looks until no release is held any more, then ends (``hold`` starts a new one)."""
        while True:
            self.watch_once()
            with self._lock:
                if not self._held:
                    self._thread = None
                    return
            time.sleep(self.interval)
