"""What the benchmarks share about processes: stopping a worker's process group, and the one-at-a-time lock."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it started (its process group): SIGTERM,
    then SIGKILL if it has not exited after ``grace`` seconds; reaped either way."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


#: One benchmark at a time: the commands that take it themselves re-execute under ``flock`` on this file.
LOCK = Path(os.environ.get("HOME", "/tmp")) / ".celery-keyed-bench.lock"
ENV_LOCKED = "CELERY_KEYED_BENCH_LOCKED"  # set in a command that holds LOCK


def run_locked(module: str, argv: list[str], lock_wait: float | None) -> None:
    """Re-execute ``python -m <module> <argv>`` under ``flock $HOME/.celery-keyed-bench.lock`` (waiting at most
    ``lock_wait`` seconds, then exit 75), unless this process holds the lock already (``ENV_LOCKED``)."""
    if os.environ.get(ENV_LOCKED):
        return
    LOCK.touch(exist_ok=True)
    print(f"waiting for {LOCK} (flock) ...", flush=True)
    wait = ["-w", str(lock_wait), "-E", "75"] if lock_wait is not None else []
    os.execvpe("flock", ["flock", *wait, str(LOCK), sys.executable, "-m", module, *argv],
               dict(os.environ, **{ENV_LOCKED: "1"}))
