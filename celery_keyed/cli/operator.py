"""What every subcommand shares: the ``Operator`` (app, settings, ledger), the decorator that builds it from
``celery -A``, the ledger's failures as clear messages, and the checks of operator input (bad input is a click
error, exit 2, and changes nothing; a ledger that cannot be reached or has no schema is exit 1)."""

from __future__ import annotations

import getpass
import math
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import update_wrapper
from typing import Any, TypeVar

import click
import sqlalchemy as sa

from celery_keyed.access import ledger_on
from celery_keyed.cli.dispatch import publish_promotions
from celery_keyed.ledger import (
    SECONDS_MAX,
    InvalidConfig,
    InvalidKey,
    Ledger,
    LedgerError,
    Promotion,
    SchemaMissing,
    normalize_key,
    schema_missing,
    validate_name,
)
from celery_keyed.settings import KeyedSettings, read_settings

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class Operator:
    """What a subcommand works with: the Celery app, its keyed settings and a ledger on a fresh engine."""

    app: Any
    settings: KeyedSettings
    engine: sa.Engine

    @property
    def ledger(self) -> Ledger:
        return ledger_on(self.engine, self.settings)

    def dispatch(self, promotions: list[Promotion]) -> None:
        """Publish what a write promoted (``celery_keyed.cli.dispatch``: a broker error is a warning)."""
        publish_promotions(self.app, promotions, dispatch_timeout=self.settings.dispatch_timeout)


def app_of(ctx: click.Context) -> Any:
    obj = ctx.obj
    app = getattr(obj, "app", None)  # celery's CLIContext
    if app is None and obj is not None and hasattr(obj, "conf"):
        app = obj  # an app passed directly as the context object (CliRunner)
    if app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj keyed ...`")
    return app


def safe_url(url: str) -> str:
    return sa.engine.make_url(url).render_as_string(hide_password=True)


class Seconds(click.FloatRange):
    """A positive, finite number of seconds up to ``maximum`` (``FloatRange`` alone lets ``nan`` through)."""

    name = "seconds"

    def __init__(self, maximum: float = SECONDS_MAX) -> None:
        super().__init__(min=0, min_open=True, max=maximum)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return number


def _first_line(exc: sa.exc.DBAPIError) -> str:
    return str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)


@contextmanager
def ledger_errors(settings: KeyedSettings, engine: sa.Engine) -> Iterator[None]:
    """Turn the ways a ledger call fails into clear messages (exit 1) instead of tracebacks."""
    where = f"ledger {safe_url(settings.database_url)}"
    try:
        yield
    except SchemaMissing as exc:
        raise click.ClickException(f"{exc} ({where})") from None
    except (sa.exc.ProgrammingError, sa.exc.OperationalError) as exc:
        missing = schema_missing(exc, engine)  # undefined_table: never migrated, or behind this version
        if missing is not None:
            raise click.ClickException(f"{missing} ({where})") from None
        if isinstance(exc, sa.exc.ProgrammingError):
            raise
        raise click.ClickException(
            f"cannot reach the ledger at {safe_url(settings.database_url)}: {_first_line(exc)}"
        ) from None
    except (InvalidConfig, InvalidKey) as exc:
        raise click.UsageError(str(exc)) from None
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from None
    except UnicodeError as exc:  # text the checks above did not see (they check every argument and the DSN)
        raise click.ClickException(f"text that is not valid UTF-8 cannot reach the ledger: {exc}") from None
    except sa.exc.DataError as exc:
        raise click.ClickException(f"the ledger refused a value: {_first_line(exc)}") from None


def pass_operator(command: F) -> F:
    """Give the subcommand an ``Operator`` built from the app of ``celery -A``; settings errors are clear."""

    @click.pass_context
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        app = app_of(ctx)
        from celery_keyed.engine import create_ledger_engine

        check_text_arguments(ctx, kwargs)
        try:
            settings = read_settings(app.conf)
            check_text(settings.database_url)
            engine = create_ledger_engine(settings)
        except (InvalidConfig, InvalidKey) as exc:
            raise click.ClickException(f"celery-keyed settings: {exc}") from None
        except ValueError as exc:
            raise click.ClickException(f"celery-keyed settings: keyed_database_url {exc}") from None
        operator = Operator(app, settings, engine)
        try:
            with ledger_errors(settings, engine):
                return ctx.invoke(command, operator, *args, **kwargs)
        finally:
            engine.dispose()

    return update_wrapper(wrapper, command)  # type: ignore[return-value]


def check_text(value: str) -> None:
    """``ValueError`` for text no ledger can take: a NUL, or a lone surrogate (what Python makes of bytes that are not
    UTF-8 in a command line or the environment), which the driver would meet as a ``UnicodeEncodeError``."""
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid UTF-8 text (a byte that is not UTF-8, read as a lone surrogate)") from None


def check_text_arguments(ctx: click.Context, values: dict[str, Any]) -> None:
    """Every text argument and option of the subcommand as ``check_text`` wants it (else a usage error, exit 2)."""
    params = {p.name: p for p in ctx.command.params}
    for name, value in values.items():
        for text in value if isinstance(value, list | tuple) else [value]:
            if not isinstance(text, str):
                continue
            try:
                check_text(text)
            except ValueError as exc:
                param = params.get(name)
                raise click.BadParameter(
                    f"{text!r:.100} {exc}", ctx=ctx, param=param,
                    param_hint=None if param is not None else repr(name),
                ) from None


def name_option(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_name(value)
    except InvalidKey as exc:
        raise click.BadParameter(str(exc), param_hint="'--name'") from None


def name_argument(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return validate_name(value)
    except InvalidKey as exc:
        raise click.BadParameter(str(exc)) from None


def key_argument(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return normalize_key(value)
    except InvalidKey as exc:
        raise click.BadParameter(str(exc)) from None


def required_reason(reason: str) -> str:
    if not reason.strip():
        raise click.BadParameter("a reason is required", param_hint="'--reason'")
    return reason


def default_author() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()} (celery keyed)"


def expiry_of(expires_in: float | None, until: str | None) -> datetime | None:
    """An override's expiry from ``--expires-in SECONDS`` or ``--until ISO`` (no offset = UTC); None: none."""
    if expires_in is not None and until is not None:
        raise click.UsageError("give --expires-in or --until, not both")
    now = datetime.now(UTC)
    if expires_in is not None:
        return now + timedelta(seconds=expires_in)
    if until is None:
        return None
    try:
        expires_at = datetime.fromisoformat(until)
    except ValueError:
        raise click.BadParameter(f"not an ISO 8601 time: {until!r}", param_hint="'--until'") from None
    if expires_at.tzinfo is None:
        expires_at = expires_at.replace(tzinfo=UTC)
    try:
        expires_at = expires_at.astimezone(UTC)
    except OverflowError:  # past 9999-12-31 in UTC: no timestamp in Python holds it
        raise click.BadParameter(f"{until!r} is past the year 9999 in UTC", param_hint="'--until'") from None
    if expires_at <= now:
        raise click.BadParameter(f"{until!r} is in the past", param_hint="'--until'")
    return expires_at
