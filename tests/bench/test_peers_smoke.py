"""A smoke run of ``python -m bench.peers``: it produces its table. No timing is asserted (benchmarks are not
tests); a tiny scale keeps it to seconds. It waits at most a minute for the benchmark lock, else it skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_peers_harness_produces_its_table() -> None:
    cmd = [sys.executable, "-m", "bench.peers", "--quick", "--systems", "plain,keyed", "--workloads", "W1",
           "--scale", "0.1", "--seconds", "0.01", "--no-install", "--lock-wait", "60"]
    env = {k: v for k, v in os.environ.items() if k != "CELERY_KEYED_BENCH_LOCKED"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    if done.returncode == 75:
        pytest.skip("another benchmark holds the benchmark lock")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "Smoke, machine shared: not evidence" in out
    assert "| system | makespan / ideal |" in out
    for label in ("plain Celery (no keys)", "celery-keyed (README settings)"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {label} |"))
        assert "error" not in row and "not installed" not in row, row
