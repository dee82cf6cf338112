"""The layers of DESIGN §4 import only what is below them."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(import_line: str) -> set[str]:
    code = f"import sys; {import_line}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return {name.split(".")[0] for name in out.split()}


def test_the_ledger_imports_neither_celery_nor_django() -> None:
    loaded = _modules_after("import celery_keyed.ledger, celery_keyed.ledger.reconcile, celery_keyed.ledger.explain")
    assert "celery" not in loaded and "kombu" not in loaded
    assert "django" not in loaded
    assert "sqlalchemy" in loaded  # the check itself works


def test_the_public_api_is_importable() -> None:
    loaded = _modules_after("from celery_keyed import keyed_task, KeyedTask, install, KeyedRejected")
    assert "celery" in loaded
