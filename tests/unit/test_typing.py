"""``keyed_task`` keeps the decorated function's signature for a type checker (mypy --strict): calls, ``delay``
and signatures are checked against it, ``bind=True`` leaves the task parameter out."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = '''
from celery_keyed import KeyedTask, keyed_task


@keyed_task(concurrency_key="account:{account_id}")
def sync_account(account_id: int) -> str:
    return str(account_id)


@keyed_task(bind=True, group_key="order:{order_id}", max_retries=5)
def apply_event(self: KeyedTask, order_id: int, event: str) -> None:
    return None


@keyed_task
def bare(n: int) -> int:
    return n


reveal_type(sync_account)
reveal_type(apply_event)
sync_account.delay(7)
apply_event.delay(1, "paid")
apply_event.s(2, "packed")
total: int = bare(2) + 1
label: str = sync_account(3)
sync_account.delay("seven")  # wrong type
apply_event.delay(1)  # missing argument
'''


def test_keyed_task_keeps_the_signature_under_mypy_strict(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(textwrap.dedent(SAMPLE))
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports", "--follow-imports=silent",
         "--no-incremental", str(sample)],
        capture_output=True, text=True, env={"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, cwd=tmp_path,
        timeout=300,
    )  # fmt: skip
    lines = [line.split(": ", 1)[1] for line in out.stdout.splitlines() if line.startswith("sample.py:")]
    assert 'note: Revealed type is "celery_keyed.task.KeyedTaskFunction[[account_id: int], str]"' in lines, out.stdout
    assert 'note: Revealed type is "celery_keyed.task.KeyedTaskFunction[[order_id: int, event: str], None]"' in lines
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, out.stdout
    source = sample.read_text().splitlines()
    wrong_type = 1 + next(i for i, line in enumerate(source) if "wrong type" in line)
    missing = 1 + next(i for i, line in enumerate(source) if "missing argument" in line)
    assert errors[0].startswith(f"sample.py:{wrong_type}:") and 'incompatible type "str"; expected "int"' in errors[0]
    assert errors[1].startswith(f"sample.py:{missing}:") and 'Missing positional argument "event"' in errors[1]
