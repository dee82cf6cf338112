"""A smoke run of ``python -m bench.gate``: scenario b and every variant of it (b0, b00, b-loop, b-loop2), each
draining its tasks through a real prefork worker, and their report rows. No timing is asserted (benchmarks are not
tests); 200 tasks per drain keep it to about half a minute."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gate_b_and_its_variants_drain_and_report() -> None:
    cmd = [sys.executable, "-m", "bench.gate", "--quick", "--only", "b", "--tasks", "200", "--without-ledger",
           "--loop-releases"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for label, title in (("b", "B keyed"), ("b0", "B0 keyed, no ledger calls"),
                         ("b00", "B00 keyed, no ledger calls, on the loop"),
                         ("b-loop", "B keyed, releases from the loop"),
                         ("b-loop2", "B keyed, claims ahead and releases from the loop")):
        assert re.search(rf"^  {label} pair 1: A plain +\d+ tasks/s, {re.escape(title)} +\d+ tasks/s, ratio [\d.]+",
                         out, re.M), (label, out)
    assert re.search(r"^b\. B/A median [\d.]+", out, re.M), out
    for label in ("b0", "b00", "b-loop", "b-loop2"):
        assert re.search(rf"^{label}\. .* / plain: median [\d.]+", out, re.M), (label, out)
    # The loop's calls released every task of their drains (bench/gate/loop_releases.py's counts, logged by each
    # worker at its exit; the harness lets the ledger see every release before it stops such a worker, since the
    # prototype does not flush its calls at a stop). A worker the harness had to kill at its stop logs none: every
    # count logged must be whole, and at least one must be logged.
    counts = re.findall(r"\{'calls': \d+, 'released': (\d+), 'not_finished': (\d+), .*'failed': (\d+)", out)
    assert counts, out
    assert all(c == ("200", "0", "0") for c in counts), (counts, out)
