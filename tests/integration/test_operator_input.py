"""An operator's input of the wrong type or shape — through the Python API, the ``Ledger`` and ``celery keyed`` — is a
clear domain error naming the argument, and changes nothing: never a driver's ``DataError`` / ``ProgrammingError``,
an ``AttributeError`` or a ``UnicodeEncodeError`` traceback; and what PostgreSQL would have read its own way (an
expiry of "tomorrow") is refused, not taken. On a real ledger."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

import celery_keyed
from celery_keyed.cli import keyed
from celery_keyed.ledger import InvalidConfig, InvalidKey, Ledger, LedgerError, override_get
from celery_keyed.publisher import close_publisher

ROOT = Path(__file__).resolve().parents[2]
SURROGATE = "\udcff"  # what Python makes of a byte that is not UTF-8 in argv or the environment


@pytest.fixture
def app(database_url: str) -> Iterator[Celery]:
    app = Celery("operator-input", broker="memory://", set_as_current=False)
    app.conf.keyed_database_url = database_url
    app.conf.keyed_concurrency_limits = {"api": 3}
    yield app
    close_publisher(app)
    app.close()


def _override(engine: sa.Engine, name: str) -> Any:
    with engine.connect() as conn:
        return override_get(conn, name)


def _audit_rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM keyed_override_log")).scalar() or 0)


BAD_CALLS: dict[str, Callable[[Any, Ledger], Any]] = {
    "NUL in a reason": lambda app, _: celery_keyed.set_limit(app, "api", 1, reason="a\x00b"),
    "a lone surrogate in a reason": lambda app, _: celery_keyed.set_limit(app, "api", 1, reason="x" + SURROGATE),
    "a reason of 100,000 characters": lambda app, _: celery_keyed.set_limit(app, "api", 1, reason="x" * 100_000),
    "a reason that is not a str": lambda app, _: celery_keyed.set_limit(app, "api", 1, reason=5),
    "an author that is not a str": lambda app, _: celery_keyed.set_limit(app, "api", 1, reason="r", author=5),
    "NUL in an author": lambda app, _: celery_keyed.set_key_limit(app, "api:1", 1, reason="r", author="\x00"),
    "expires_at=5": lambda app, _: celery_keyed.set_limit(app, "api", 1, reason="r", expires_at=5),
    "expires_at='tomorrow'": lambda app, _: celery_keyed.set_limit(app, "api", 1, reason="r", expires_at="tomorrow"),
    "a key limit until 'tomorrow'":
        lambda app, _: celery_keyed.set_key_limit(app, "api:1", 1, reason="r", expires_at="tomorrow"),
    "a key limit until 5": lambda app, _: celery_keyed.set_key_limit(app, "api:1", 1, reason="r", expires_at=5),
    "clear_limit(app, 5)": lambda app, _: celery_keyed.clear_limit(app, 5),
    "NUL in a clear's reason": lambda app, _: celery_keyed.clear_limit(app, "api", reason="\x00"),
    "pause_key of an int": lambda app, _: celery_keyed.pause_key(app, 5, 5, reason="r"),
    "pause_key of a 3-tuple": lambda app, _: celery_keyed.pause_key(app, ("api", 1, 2), 5, reason="r"),
    "NUL in a pause's reason": lambda app, _: celery_keyed.pause_key(app, "api:1", 5, reason="\x00"),
    "a pause's reason of 100,000 characters":
        lambda app, _: celery_keyed.pause_key(app, "api:1", 5, reason="x" * 100_000),
    "resume_key of an int": lambda app, _: celery_keyed.resume_key(app, 5),
    "clear_key_limit of an int": lambda app, _: celery_keyed.clear_key_limit(app, 5),
    "Ledger.explain(5)": lambda _, ledger: ledger.explain(5),  # type: ignore[arg-type]
    "Ledger.explain of a lone surrogate": lambda _, ledger: ledger.explain("a" + SURROGATE),
    "revoke of an int": lambda app, _: celery_keyed.revoke(app, 5),  # type: ignore[arg-type]
}  # fmt: skip


@pytest.mark.parametrize("label", list(BAD_CALLS))
def test_wrong_input_is_a_clear_error_and_changes_nothing(
    label: str, app: Celery, ledger: Ledger, engine: sa.Engine
) -> None:
    celery_keyed.set_limit(app, "api", 2, reason="before")
    before = _audit_rows(engine)
    with pytest.raises((InvalidConfig, InvalidKey)) as caught:
        BAD_CALLS[label](app, ledger)
    assert isinstance(caught.value, LedgerError) and isinstance(caught.value, ValueError)
    assert _audit_rows(engine) == before, label
    assert _override(engine, "api").slot_limit == 2


def test_what_is_right_still_works(app: Celery, ledger: Ledger, engine: sa.Engine) -> None:
    """The same calls with values of the right shape: a reason of 500 characters, a naive expiry (taken as UTC, as
    ``celery keyed --until`` takes it), a tuple key like a task's."""
    soon = datetime.now(UTC).replace(tzinfo=None) + timedelta(hours=1)
    celery_keyed.set_limit(app, "api", 1, reason="x" * 500, expires_at=soon)
    stored = _override(engine, "api")
    assert stored is not None and stored.expires_at == soon.replace(tzinfo=UTC)
    until = celery_keyed.pause_key(app, ("api", 7), 5, reason="tuple key")
    assert until > datetime.now(UTC)
    assert celery_keyed.resume_key(app, ("api", 7)) is True  # type: ignore[arg-type]
    celery_keyed.clear_limit(app, "api", reason="done")
    assert ledger.explain("never-seen").state == "unknown"


def run(app: Celery, *args: str, code: int) -> Result:
    result = CliRunner().invoke(keyed, list(args), obj=CLIContext(app=app, no_color=True, workdir=None))
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return result


def test_the_command_line_refuses_text_no_ledger_can_take(app: Celery, engine: sa.Engine) -> None:
    """A byte that is not UTF-8 in an argument (Python reads it as a lone surrogate) printed a ``UnicodeEncodeError``
    traceback from the driver; now a usage error naming the argument, exit 2, and nothing written."""
    cases = {
        ("explain", "a" + SURROGATE): "'TASK_ID'",
        ("set-limit", "api", "1", "--reason", "x" + SURROGATE): "'--reason'",
        ("set-limit", "api", "1", "--reason", "x", "--author", SURROGATE): "'--author'",
        ("set-limit", "api", "1", "--reason", "a\x00b"): "'--reason'",
        ("status", "--name", "a" + SURROGATE): "'--name'",
    }
    for args, hint in cases.items():
        result = run(app, *args, code=2)
        assert hint in result.output and "Traceback" not in result.output, (args, result.output)
    result = run(app, "set-limit", "api", "1", "--reason", "x" * 501, code=2)
    assert "at most 500 characters" in result.output
    assert _audit_rows(engine) == 0


def test_a_dsn_that_is_not_utf8_is_a_settings_error(app: Celery, database_url: str) -> None:
    app.conf.keyed_database_url = database_url + SURROGATE
    result = run(app, "status", code=1)
    assert "keyed_database_url is not valid UTF-8 text" in result.output
    assert SURROGATE not in result.output and "Traceback" not in result.output


def test_explain_of_an_unknown_task_exits_non_zero(app: Celery, ledger: Ledger) -> None:
    assert "unknown" in run(app, "explain", "nope", code=1).output
    assert '"state": "unknown"' in run(app, "explain", "nope", "--json", code=1).output


def test_the_real_command_with_a_byte_that_is_not_utf8(database_url: str) -> None:
    """Through the real ``celery`` program: the argument arrives as Python reads a command line."""
    env = {
        **os.environ, "KEYED_DATABASE_URL": database_url, "CELERY_BROKER_URL": "memory://", "PYTHONPATH": str(ROOT),
        "PYTHONWARNINGS": "ignore",
    }  # fmt: skip
    celery = [sys.executable, "-m", "celery", "-A", "tests.integration.cli_app", "keyed"]
    done = subprocess.run(
        [os.fsencode(a) for a in celery] + [b"explain", b"a\xffb"], cwd=ROOT, env=env, capture_output=True, timeout=60
    )
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 2 and "not valid UTF-8 text" in stderr and "Traceback" not in stderr, stderr
