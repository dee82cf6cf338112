"""A smoke run of ``python -m bench.statements --wal``: it produces its tables, the server's CPU per task and the
WAL per task (by record type where the server's binaries include ``pg_waldump``), and with ``--sizes`` the cost per
task at each batch size with its fit. No timing is asserted (benchmarks are not tests); 20 rounds on 30 keys keep it
to seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_statements_produces_its_tables() -> None:
    cmd = [sys.executable, "-m", "bench.statements", "--batches", "20", "--keys", "30", "--wal", "--sizes", "1,3"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "20 rounds of a claim of 3 and their release" in out
    assert "keyed_claim_many" in out and "keyed_release_many" in out
    assert re.search(r"server CPU per task: \d+ µs in the backends", out), out
    wal = re.search(r"WAL per task: (\d+) B", out)
    assert wal and int(wal.group(1)) > 0, out
    # Every task writes its books row and its claim row: with pg_waldump, their heap inserts are in the table.
    assert "| Heap/INSERT |" in out or "WAL by record type: no pg_waldump" in out, out
    # --sizes: a row per batch size and the fit of each cost into a part per task and a part per round.
    assert re.search(r"^\| 1 \| \d+ \| \d+ \| \d+ \| [\d.]+ \|$", out, re.M), out
    assert re.search(r"^\| 3 \| \d+ \| \d+ \| \d+ \| [\d.]+ \|$", out, re.M), out
    assert re.search(r"client CPU, µs: -?\d+ per task \+ -?\d+ per round", out), out


def test_sizes_must_be_batch_sizes() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.statements", "--sizes", "1,x"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--sizes takes batch sizes" in done.stderr, done.stderr
