"""The tutorial (docs/tutorial.md) as a reader runs it: its two files written as the page shows them, its commands
run against a throwaway PostgreSQL and Redis, a real prefork worker of four processes — and what the page says
happens does: account 1's syncs one at a time, account 2's beside them, two at a time once the limit is raised."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()
LINE = re.compile(r"^account (\d+): (\d+\.\d)s to (\d+\.\d)s$")


def section(heading: str) -> str:
    start = TUTORIAL.index(f"\n## {heading}\n")
    end = TUTORIAL.find("\n## ", start + 1)
    return TUTORIAL[start : end if end != -1 else None]


def blocks(heading: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section(heading), flags=re.S)


def runs_of(output: str) -> dict[int, list[tuple[float, float]]]:
    """account -> its (start, end) as send.py printed them (tenths of a second)."""
    runs: dict[int, list[tuple[float, float]]] = {}
    for line in output.strip().splitlines():
        match = LINE.match(line)
        assert match, f"send.py printed {line!r}"
        runs.setdefault(int(match[1]), []).append((float(match[2]), float(match[3])))
    return runs


def most_at_once(runs: list[tuple[float, float]]) -> int:
    """The most runs that overlap one another (intervals that overlap pairwise share a moment). Printed in tenths of
    a second, two runs count as overlapping when they share more than 0.2 s: a broken bound would overlap by a whole
    sync (1 s)."""

    def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return min(a[1], b[1]) - max(a[0], b[0]) > 0.2

    return max(
        len(chosen)
        for chosen in itertools.chain.from_iterable(
            itertools.combinations(runs, n) for n in range(1, len(runs) + 1)
        )
        if all(overlap(a, b) for a, b in itertools.combinations(chosen, 2))
    )


def test_the_tutorial_runs_as_written(tmp_path: Path, blank_database_url: str, redis_url: str) -> None:
    (module,) = blocks("3. A keyed task", "python")
    (send,) = blocks("5. Send work", "python")
    (tmp_path / "tutorial.py").write_text(module)
    (tmp_path / "send.py").write_text(send)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "KEYED_", "DJANGO_"))},
        "CELERY_BROKER_URL": redis_url,
        "KEYED_DATABASE_URL": blank_database_url,
        "PYTHONPATH": str(tmp_path),
    }

    def run(*args: str, timeout: float = 120) -> str:
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def celery(*args: str) -> str:
        return run(sys.executable, "-m", "celery", "-A", "tutorial", *args)

    commands = blocks("4. Create the ledger's tables and start a worker", "sh")[0].split("\n")
    assert commands[0] == "celery -A tutorial keyed migrate"
    assert commands[1].startswith("celery -A tutorial worker --concurrency 4")
    celery("keyed", "migrate")
    with (tmp_path / "worker.log").open("w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tutorial", "worker", "--concurrency", "4", "--loglevel", "info",
             "--without-gossip", "--without-mingle", "--hostname", "tutorial@%h"],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        runs = runs_of(run(sys.executable, "send.py"))
        assert sorted(runs) == [1, 2] and len(runs[1]) == 3 and len(runs[2]) == 1
        assert most_at_once(runs[1]) == 1, runs  # one at a time per account
        assert runs[2][0][0] < max(start for start, _ in runs[1]), runs  # account 2 did not wait for account 1

        assert "account" in celery("keyed", "status")
        raise_limit = blocks("7. Change the limit while the worker runs", "sh")[0].split("\n")[0]
        assert raise_limit.startswith("celery -A tutorial keyed set-limit account 2 --reason ")
        celery("keyed", "set-limit", "account", "2", "--reason", "tutorial: two syncs per account")
        assert "override" in celery("keyed", "status")
        runs = runs_of(run(sys.executable, "send.py"))
        assert most_at_once(runs[1]) <= 2, runs  # the raised limit, never more
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
