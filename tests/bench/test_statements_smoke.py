"""A smoke run of ``python -m bench.statements --wal``: it produces its tables, the server's CPU per task and the
WAL per task (by record type where the server's binaries include ``pg_waldump``). No timing is asserted (benchmarks
are not tests); 20 rounds on 30 keys keep it to seconds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_statements_produces_its_tables() -> None:
    cmd = [sys.executable, "-m", "bench.statements", "--batches", "20", "--keys", "30", "--wal"]
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
