"""``celery keyed``: the operator's command line (registered through the ``celery.commands`` entry point).

    celery -A proj keyed status [--name NAME] [--limit N] [--all] [--json]
    celery -A proj keyed explain TASK_ID [--json]
    celery -A proj keyed set-limit NAME N --reason TEXT [--expires-in SECONDS | --until ISO] [--author WHO]
    celery -A proj keyed clear-limit NAME [--reason TEXT] [--author WHO]
    celery -A proj keyed reconcile [--reclaim] [--json]
    celery -A proj keyed migrate [--json]
    celery -A proj keyed inspect [--timeout SECONDS] [--json]

Every subcommand reads the ledger from the app's ``keyed_database_url``. Reads go through
``celery_keyed.ledger.status`` / ``explain``; writes through the ledger's own functions (overrides with their
audit rows, reconcile, migrate). Bad input is a click error (exit 2) and changes nothing; a ledger that cannot be
reached or has no schema is an error too (exit 1). ``--json`` prints one JSON document for scripts.
"""

from __future__ import annotations

import decimal
import getpass
import json
import math
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import update_wrapper
from typing import Any, TypeVar

import click
import sqlalchemy as sa

from celery_keyed.access import dispatch, ledger_on
from celery_keyed.ledger import (
    FAIR_WEIGHT_MAX,
    FAIR_WEIGHT_MIN,
    INT_MAX,
    SECONDS_MAX,
    SLOT_LIMIT_MAX,
    STATEMENT_TIMEOUT_MAX,
    FairShare,
    InvalidConfig,
    InvalidKey,
    KeyOverride,
    KeyStatus,
    Ledger,
    LedgerError,
    NameStatus,
    Promotion,
    Report,
    SchemaMissing,
    applied_versions,
    check_counters_once,
    drop_idle_keys_once,
    fair_shares,
    fair_weight_overrides,
    holders_latest,
    key_overrides_live,
    migrate,
    names_newest_version,
    normalize_key,
    outbox_by_name,
    override_get,
    schema_missing,
    sent_by_name,
    status_key_count,
    status_keys,
    status_names,
    status_now,
    status_prepare,
    validate_name,
)
from celery_keyed.settings import KeyedSettings, read_settings

F = TypeVar("F", bound=Callable[..., Any])


# -- plumbing ----------------------------------------------------------------------------------------------


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
        """Publish promoted attempts with their admission nonce (``access.dispatch``, as the beat task does). The
        ledger change is committed already: a promotion that cannot be published stays in the ledger and goes back
        in line after ``keyed_dispatch_timeout``, so a broker error is a warning, not a failure of the command."""
        done = dispatch(self.app, promotions)
        if done.failed:
            click.echo(
                f"warning: {len(done.failed)} promoted task(s) could not be published ({done.error}); they go back "
                f"in line after keyed_dispatch_timeout ({self.settings.dispatch_timeout:g}s)",
                err=True,
            )


def _app_of(ctx: click.Context) -> Any:
    obj = ctx.obj
    app = getattr(obj, "app", None)  # celery's CLIContext
    if app is None and obj is not None and hasattr(obj, "conf"):
        app = obj  # an app passed directly as the context object (CliRunner)
    if app is None:
        raise click.UsageError("no Celery app: run it as `celery -A proj keyed ...`")
    return app


def _safe_url(url: str) -> str:
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


@contextmanager
def _ledger_errors(settings: KeyedSettings, engine: sa.Engine) -> Iterator[None]:
    """Turn the ways a ledger call fails into clear messages (exit 1) instead of tracebacks."""
    try:
        yield
    except SchemaMissing as exc:
        raise click.ClickException(f"{exc} (ledger {_safe_url(settings.database_url)})") from None
    except sa.exc.ProgrammingError as exc:
        missing = schema_missing(exc, engine)  # undefined_table: never migrated, or behind this version
        if missing is not None:
            raise click.ClickException(f"{missing} (ledger {_safe_url(settings.database_url)})") from None
        raise
    except sa.exc.OperationalError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
        raise click.ClickException(f"cannot reach the ledger at {_safe_url(settings.database_url)}: {first}") from None
    except (InvalidConfig, InvalidKey) as exc:
        raise click.UsageError(str(exc)) from None
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from None
    except UnicodeError as exc:  # text the checks above did not see (they check every argument and the DSN)
        raise click.ClickException(f"text that is not valid UTF-8 cannot reach the ledger: {exc}") from None
    except sa.exc.DataError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
        raise click.ClickException(f"the ledger refused a value: {first}") from None


def pass_operator(command: F) -> F:
    """Give the subcommand an ``Operator`` built from the app of ``celery -A``; settings errors are clear."""

    @click.pass_context
    def wrapper(ctx: click.Context, *args: Any, **kwargs: Any) -> Any:
        app = _app_of(ctx)
        from celery_keyed.engine import create_ledger_engine

        _check_text_arguments(ctx, kwargs)
        try:
            settings = read_settings(app.conf)
            _check_text(settings.database_url)
            engine = create_ledger_engine(settings)
        except (InvalidConfig, InvalidKey) as exc:
            raise click.ClickException(f"celery-keyed settings: {exc}") from None
        except ValueError as exc:
            raise click.ClickException(f"celery-keyed settings: keyed_database_url {exc}") from None
        operator = Operator(app, settings, engine)
        try:
            with _ledger_errors(settings, engine):
                return ctx.invoke(command, operator, *args, **kwargs)
        finally:
            engine.dispose()

    return update_wrapper(wrapper, command)  # type: ignore[return-value]


def _check_text(value: str) -> None:
    """``ValueError`` for text no ledger can take: a NUL, or a lone surrogate (what Python makes of bytes that are not
    UTF-8 in a command line or the environment), which the driver would meet as a ``UnicodeEncodeError``."""
    if "\x00" in value:
        raise ValueError("contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid UTF-8 text (a byte that is not UTF-8, read as a lone surrogate)") from None


def _check_text_arguments(ctx: click.Context, values: dict[str, Any]) -> None:
    """Every text argument and option of the subcommand as ``_check_text`` wants it (else a usage error, exit 2)."""
    params = {p.name: p for p in ctx.command.params}
    for name, value in values.items():
        for text in value if isinstance(value, list | tuple) else [value]:
            if not isinstance(text, str):
                continue
            try:
                _check_text(text)
            except ValueError as exc:
                param = params.get(name)
                raise click.BadParameter(
                    f"{text!r:.100} {exc}", ctx=ctx, param=param,
                    param_hint=None if param is not None else repr(name),
                ) from None


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID | timedelta):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _print_json(document: Any) -> None:
    click.echo(json.dumps(document, default=_json_default, indent=2, sort_keys=True))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[int] = ()) -> str:
    """A plain text table (no borders), columns as wide as their widest cell; ``right``: right-aligned columns."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _name_option(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_name(value)
    except InvalidKey as exc:
        raise click.BadParameter(str(exc), param_hint="'--name'") from None


def _name_argument(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return validate_name(value)
    except InvalidKey as exc:
        raise click.BadParameter(str(exc)) from None


def _default_author() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()} (celery keyed)"


# -- the group ---------------------------------------------------------------------------------------------


@click.group(name="keyed")
def keyed() -> None:
    """celery-keyed: see and steer the slot ledger (limits, keys, waiting tasks)."""


# -- status ------------------------------------------------------------------------------------------------


@keyed.command()
@click.option("--name", "name", metavar="NAME", help="Only this name and its keys.")
@click.option(
    "--limit",
    "limit",
    type=click.IntRange(min=0, max=INT_MAX),
    default=20,
    show_default=True,
    metavar="N",
    help="At most N rows of keys (busiest first); 0 = names only.",
)
@click.option("--all", "idle", is_flag=True, help="Also list keys with nothing in flight or waiting.")
@click.option(
    "--timeout",
    type=Seconds(STATEMENT_TIMEOUT_MAX),
    default=30.0,
    show_default=True,
    help="Seconds the queries may take.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def status(operator: Operator, name: str | None, limit: int, idle: bool, timeout: float, as_json: bool) -> None:
    """Names and keys: limit and where it comes from (override, config, default), in flight, waiting, oldest wait.

    One aggregated query per table, so it stays fast on 100,000 keys; keys are the busiest N
    (most waiting, then most in flight)."""
    name = _name_option(name)
    with operator.engine.begin() as conn:
        status_prepare(conn, timeout=timeout)
        at = status_now(conn)
        names = status_names(conn, name=name)
        key_rows = status_keys(conn, name=name, limit=limit, idle=idle) if limit else []
        total = status_key_count(conn, name=name)
        newest = names_newest_version(conn)
        workers = [dict(r._mapping) for r in holders_latest(conn)]
        sends = [s for s in sent_by_name(conn) if name is None or s.name == name]
        outbox = [o for o in outbox_by_name(conn) if name is None or o.name == name]
        key_overrides = key_overrides_live(conn, name=name)  # a key's own pause or limit (issue 14 item 4)
        shares = fair_shares(conn, name=name, limit=max(limit, 1) * 10) if limit else []
    notes = _config_notes(operator.settings, names, name) + _version_notes(operator.settings, newest, workers)
    if as_json:
        _print_json(
            {
                "at": at,
                "names": [n.as_dict() for n in names],
                "keys": [k.as_dict() for k in key_rows],
                "keys_total": total,
                "config_version": newest,
                "workers": workers,
                "sends": [s.as_dict() for s in sends],
                "outbox": [o.as_dict() for o in outbox],
                "key_overrides": [k.as_dict() for k in key_overrides],
                "fair_shares": [f.as_dict() for f in shares],
                "notes": notes,
            }
        )
        return
    click.echo(_names_table(names) if names else "no names: the ledger has no configured name, override or key yet")
    if limit:
        click.echo()
        if key_rows:
            click.echo(_keys_table(key_rows))
        busy = sum(n.busy_keys for n in names)
        shown = f"{len(key_rows)} of {total} keys shown" if idle else f"{len(key_rows)} of {busy} busy keys shown"
        click.echo(f"({shown}; {total} keys in the ledger" + (f" for {name})" if name else ")"))
    if key_overrides:
        click.echo()
        click.echo(key_overrides_table(key_overrides))
    if shares:
        click.echo()
        click.echo(fair_shares_table(shares))
    if workers:
        click.echo()
        click.echo(f"configuration version stored: {newest}")
        click.echo(_workers_table(workers, newest))
    if sends:
        click.echo()
        click.echo(_sends_table(sends))
    if outbox:
        click.echo()
        click.echo(_outbox_table(outbox))
    for note in notes:
        click.echo(f"note: {note}", err=True)


def _config_notes(settings: KeyedSettings, names: list[NameStatus], only: str | None) -> list[str]:
    """Where this app's ``keyed_concurrency_limits`` and the ledger's configured limits disagree: the ledger
    holds what the workers synced when they started, so a changed setting shows here until they restart."""
    stored = {n.name: n.configured_limit for n in names}
    notes = []
    for config_name, config in sorted(settings.limits.items()):
        if only is not None and config_name != only:
            continue
        if stored.get(config_name) != config.limit:
            held = stored.get(config_name)
            notes.append(
                f"{config_name}: this app configures limit {config.limit}, the ledger has "
                + ("no configuration (default 1)" if held is None else f"{held}")
                + ": workers store the configuration when they start"
            )
    return notes


def _version_notes(settings: KeyedSettings, newest: int, workers: list[dict[str, Any]]) -> list[str]:
    """Rolling deploys (issue 14 item 7): workers whose latest start runs an older configuration version than the
    one stored, and this app's own version when it is older."""
    notes = [
        f"worker {w['hostname']} runs configuration version {w['config_version']}, older than the stored {newest}"
        for w in workers
        if w["config_version"] is not None and w["config_version"] < newest
    ]
    if settings.config_version < newest:
        notes.append(
            f"this app's keyed_config_version is {settings.config_version}, older than the stored {newest}: workers"
            " started with it keep the newer limits"
        )
    return notes


def _workers_table(workers: list[dict[str, Any]], newest: int) -> str:
    rows = [
        (
            w["hostname"],
            w["pid"],
            _when(w["started_at"]),
            "-" if w["config_version"] is None else w["config_version"],
            "older" if w["config_version"] is not None and w["config_version"] < newest else "",
            w["claims"],
        )
        for w in workers
    ]
    return render_table(("WORKER", "PID", "STARTED", "CONFIG VERSION", "", "CLAIMS"), rows, right=(1, 3, 5))


def _sends_table(sends: list[Any]) -> str:
    rows = [(s.name, s.in_flight, s.refused_full, s.refused_duplicate) for s in sends]
    return render_table(
        ("NAME", "SENT NOT ARRIVED", "REFUSED ROOM FULL", "REFUSED DUPLICATE"), rows, right=(1, 2, 3)
    )


def _outbox_table(outbox: list[Any]) -> str:
    """Registered at publish and not received yet (issue 14 item 8), per name."""
    rows = [
        (o.name, o.not_received, o.pending, o.republished_tasks, o.republished, _when(o.oldest))
        for o in outbox
    ]
    return render_table(
        ("NAME", "REGISTERED NOT RECEIVED", "NOT PUBLISHED YET", "REPUBLISHED TASKS", "REPUBLISHES", "OLDEST"),
        rows,
        right=(1, 2, 3, 4),
    )


def _names_table(names: list[NameStatus]) -> str:
    rows = []
    for n in names:
        note = ""
        if n.source == "override":
            note = ("PAUSED " if n.paused else "") + f"by {n.override_author or '?'}"
            if n.override_expires_at is not None:
                note += f" until {_when(n.override_expires_at)}"
            if n.configured_limit is not None:
                note += f" (config {n.configured_limit})"
            note += f": {n.override_reason}"
        elif n.paused:
            note = "PAUSED"
        if n.paused_keys or n.limited_keys:
            note = "; ".join(x for x in (note, key_overrides_note(n)) if x)
        waiting = f"{n.waiting} ({n.debounced} debounced)" if n.debounced else n.waiting
        rows.append(
            (n.name, n.limit, n.source, _rules(n), n.keys, n.in_flight, waiting, _age(n.oldest_waiting_age), note)
        )
    return render_table(
        ("NAME", "LIMIT", "SOURCE", "RULES", "KEYS", "IN FLIGHT", "WAITING", "OLDEST WAIT", "OVERRIDE"),
        rows,
        right=(1, 4, 5, 6, 7),
    )


def _rules(n: NameStatus) -> str:
    """A name's rules besides its limit: rate (with burst), fair sharing, uncertain hold; "-" when none."""
    rules = []
    if n.rate is not None:
        # the unit that shows it as a whole number, as it was most likely configured ("100/m", "6/s")
        rate = next(
            (
                f"{round(n.rate * per):g}/{unit}"
                for unit, per in (("s", 1), ("m", 60), ("h", 3600))
                if abs(n.rate * per - round(n.rate * per)) < 1e-6 and round(n.rate * per) >= 1
            ),
            f"{n.rate:g}/s",
        )
        rules.append(f"rate {rate}" + (f" burst {n.burst:g}" if n.burst else ""))
    if n.fair:
        rules.append("fair")
    if n.uncertain_hold:
        rules.append(f"uncertain {n.uncertain_hold:g}s")
    return ", ".join(rules) or "-"


def _keys_table(keys: list[KeyStatus]) -> str:
    rows = [(k.key, k.limit, k.source, k.in_flight, k.waiting, _age(k.oldest_waiting_age)) for k in keys]
    return render_table(("KEY", "LIMIT", "SOURCE", "IN FLIGHT", "WAITING", "OLDEST WAIT"), rows, right=(1, 3, 4, 5))


# -- explain -----------------------------------------------------------------------------------------------


@keyed.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def explain(operator: Operator, task_id: str, as_json: bool) -> None:
    """Why task TASK_ID is (not) running: its state in the ledger, in words and numbers. Exits 1 when the ledger has
    no record of it (state "unknown"), after saying so."""
    if not task_id.strip():
        raise click.BadParameter("a task id cannot be blank", param_hint="'TASK_ID'")
    explanation = operator.ledger.explain(task_id)
    if as_json:
        _print_json(
            {
                "task_id": explanation.task_id,
                "state": explanation.state,
                "text": explanation.text,
                "facts": explanation.facts,
            }
        )
    else:
        click.echo(f"{explanation.task_id}: {explanation.state}")
        click.echo(f"  {explanation.text}")
        for fact, value in explanation.facts.items():
            if value is None:
                continue  # --json has every fact
            click.echo(f"  {fact}: {_when(value) if isinstance(value, datetime) else value}")
    if explanation.state == "unknown":
        raise click.exceptions.Exit(1)


# -- set-limit / clear-limit -------------------------------------------------------------------------------


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


@keyed.command("set-limit", context_settings={"ignore_unknown_options": True})  # "-1" is a bad N, not an option
@click.argument("name", callback=_name_argument)
@click.argument("limit", type=click.IntRange(min=0, max=SLOT_LIMIT_MAX), metavar="N")
@click.option("--reason", required=True, help="Why (required; kept in the audit trail).")
@click.option(
    "--expires-in",
    type=Seconds(),
    metavar="SECONDS",
    help="The override lapses by itself after this many seconds.",
)
@click.option(
    "--until",
    "until",
    metavar="ISO",
    help="The override lapses by itself at this time (ISO 8601; no offset = UTC).",
)
@click.option("--author", default=None, help="Who sets it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def set_limit(
    operator: Operator,
    name: str,
    limit: int,
    reason: str,
    expires_in: float | None,
    until: str | None,
    author: str | None,
    as_json: bool,
) -> None:
    """Override the limit of NAME at runtime: N slots per key (0 pauses every NAME:* key).

    Takes effect at the next claim, without restart; lowering never preempts running tasks. Raising it
    promotes waiting tasks at once."""
    if not reason.strip():
        raise click.BadParameter("a reason is required", param_hint="'--reason'")
    expires_at = expiry_of(expires_in, until)
    author = author if author is not None else _default_author()
    with operator.engine.connect() as conn:
        before = status_names(conn, name=name)
    previous = before[0] if before else None
    known = name in operator.settings.limits or (
        previous is not None and (previous.keys > 0 or previous.source != "default")
    )
    promotions = operator.ledger.set_override(name, limit, reason=reason, author=author, expires_at=expires_at)
    operator.dispatch(promotions)
    result = {
        "name": name,
        "limit": limit,
        "paused": limit == 0,
        "reason": reason,
        "author": author,
        "expires_at": expires_at,
        "previous_limit": previous.limit if previous else 1,
        "previous_source": previous.source if previous else "default",
        "promoted": len(promotions),
        "known_name": known,
    }
    if as_json:
        _print_json(result)
        return
    if not known:
        click.echo(
            f"note: {name!r} is not in keyed_concurrency_limits and the ledger has seen no {name}:* key; "
            "the override applies to any such key from now on",
            err=True,
        )
    was = f"was {result['previous_limit']} ({result['previous_source']})"
    what = "paused" if limit == 0 else f"limit {limit}"
    until_text = f" until {_when(expires_at)}" if expires_at else ""
    click.echo(f"{name}: {what}{until_text}, {was}; {len(promotions)} waiting task(s) promoted")


@keyed.command("clear-limit")
@click.argument("name", callback=_name_argument)
@click.option("--reason", default="", help="Why (kept in the audit trail).")
@click.option("--author", default=None, help="Who clears it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def clear_limit(operator: Operator, name: str, reason: str, author: str | None, as_json: bool) -> None:
    """Remove the runtime override of NAME: its configured limit (or 1) applies again at once."""
    author = author if author is not None else _default_author()
    with operator.engine.connect() as conn:
        existing = override_get(conn, name)
    promotions: list[Promotion] = []
    if existing is not None:
        promotions = operator.ledger.clear_override(name, reason=reason, author=author)
        operator.dispatch(promotions)
    with operator.engine.connect() as conn:
        after = status_names(conn, name=name)
    now_limit = after[0].limit if after else 1
    now_source = after[0].source if after else "default"
    result = {
        "name": name,
        "cleared": existing is not None,
        "previous_limit": existing.slot_limit if existing is not None else None,
        "limit": now_limit,
        "source": now_source,
        "promoted": len(promotions),
    }
    if as_json:
        _print_json(result)
        return
    if existing is None:
        click.echo(f"{name}: no override to clear (nothing changed); limit {now_limit} ({now_source})")
        return
    click.echo(
        f"{name}: override {existing.slot_limit} cleared; limit {now_limit} ({now_source}); "
        f"{len(promotions)} waiting task(s) promoted"
    )


# -- key overrides: pause-key / resume-key / set-key-limit / clear-key-limit (issue 14 item 4) ----------------


def _key_argument(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return normalize_key(value)
    except InvalidKey as exc:
        raise click.BadParameter(str(exc)) from None


def _reason(reason: str) -> str:
    if not reason.strip():
        raise click.BadParameter("a reason is required", param_hint="'--reason'")
    return reason


def key_overrides_note(n: NameStatus) -> str:
    """The names table's word on a name's keys with an override of their own."""
    parts = []
    if n.paused_keys:
        parts.append(f"{n.paused_keys} key{'s' if n.paused_keys != 1 else ''} paused")
    if n.limited_keys:
        parts.append(f"{n.limited_keys} key{'s' if n.limited_keys != 1 else ''} with own limit")
    return ", ".join(parts)


def key_overrides_table(overrides: list[KeyOverride]) -> str:
    """The keys with an override of their own in force: paused until when and why, their own limit and why."""
    rows = [
        (
            o.key,
            o.effective_limit,
            "-" if o.paused_until is None else _when(o.paused_until),
            "-" if o.paused_until is None else f"{o.pause_reason} ({o.pause_author or '?'})",
            "-" if o.slot_limit is None else o.slot_limit,
            "-" if o.slot_limit is None else _when(o.expires_at) if o.expires_at else "until cleared",
            "-" if o.slot_limit is None else f"{o.reason} ({o.author or '?'})",
        )
        for o in overrides
    ]
    return "key overrides (a key's own pause or limit; a paused name pauses every key)\n" + render_table(
        ("KEY", "LIMIT NOW", "PAUSED UNTIL", "PAUSE REASON", "OWN LIMIT", "LIMIT UNTIL", "LIMIT REASON"),
        rows,
        right=(1, 4),
    )


def _done(as_json: bool, result: dict[str, Any], text: str) -> None:
    if as_json:
        _print_json(result)
    else:
        click.echo(text)


@keyed.command("pause-key")
@click.argument("key", callback=_key_argument)
@click.option("--for", "seconds", type=Seconds(), metavar="SECONDS", help="Pause for this many seconds.")
@click.option("--until", "until", metavar="ISO", help="Pause until this time (ISO 8601; no offset = UTC).")
@click.option("--reason", required=True, help="Why (required; kept in the audit trail).")
@click.option("--author", default=None, help="Who pauses it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def pause_key_command(
    operator: Operator, key: str, seconds: float | None, until: str | None, reason: str, author: str | None,
    as_json: bool,
) -> None:
    """Pause one KEY (not its whole name): no task of KEY starts before the pause ends; running ones go on; waiting
    ones keep their places and start when it ends. Only ever extends a pause (resume-key ends it)."""
    _reason(reason)
    if (seconds is None) == (until is None):
        raise click.UsageError("give --for SECONDS or --until ISO (one of the two)")
    author = author if author is not None else _default_author()
    paused_until, changed = operator.ledger.pause_key(
        key, seconds, until=expiry_of(None, until), reason=reason, author=author
    )
    result = {"key": key, "paused_until": paused_until, "changed": changed, "reason": reason, "author": author}
    text = (
        f"{key}: paused until {_when(paused_until)}"
        if changed
        else f"{key}: already paused until {_when(paused_until)} (a pause is only extended; nothing changed)"
    )
    _done(as_json, result, text)


@keyed.command("resume-key")
@click.argument("key", callback=_key_argument)
@click.option("--reason", default="", help="Why (kept in the audit trail).")
@click.option("--author", default=None, help="Who resumes it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def resume_key_command(operator: Operator, key: str, reason: str, author: str | None, as_json: bool) -> None:
    """End the pause of KEY now: its waiting tasks start (as its limit allows)."""
    author = author if author is not None else _default_author()
    promotions = operator.ledger.resume_key(key, reason=reason, author=author)
    operator.dispatch(promotions or [])
    promoted = len(promotions or [])
    result = {"key": key, "resumed": promotions is not None, "promoted": promoted}
    text = (
        f"{key}: resumed; {promoted} waiting task(s) promoted"
        if promotions is not None
        else f"{key}: not paused (nothing changed)"
    )
    _done(as_json, result, text)


@keyed.command("set-key-limit", context_settings={"ignore_unknown_options": True})  # "-1" is a bad N
@click.argument("key", callback=_key_argument)
@click.argument("limit", type=click.IntRange(min=0, max=SLOT_LIMIT_MAX), metavar="N")
@click.option("--reason", required=True, help="Why (required; kept in the audit trail).")
@click.option("--expires-in", type=Seconds(), metavar="SECONDS", help="The limit lapses after this many seconds.")
@click.option("--until", "until", metavar="ISO", help="The limit lapses at this time (ISO 8601; no offset = UTC).")
@click.option("--author", default=None, help="Who sets it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def set_key_limit_command(
    operator: Operator, key: str, limit: int, reason: str, expires_in: float | None, until: str | None,
    author: str | None, as_json: bool,
) -> None:
    """Give one KEY a limit of its own: N tasks of KEY at once, cluster-wide, instead of its name's limit (other keys
    of the name keep theirs). Lowering never preempts; raising promotes waiting tasks at once."""
    _reason(reason)
    if expires_in is not None and until is not None:
        raise click.UsageError("give --expires-in or --until, not both")
    author = author if author is not None else _default_author()
    expires_at = expiry_of(None, until)  # --expires-in goes to the ledger as seconds, counted on its clock
    promotions = operator.ledger.set_key_limit(
        key, limit, reason=reason, author=author, expires_at=expires_at, expires_in=expires_in
    )
    operator.dispatch(promotions)
    own = operator.ledger.key_override(key)
    lapses = None if own is None else own.expires_at
    result = {
        "key": key, "limit": limit, "expires_at": lapses, "reason": reason, "author": author,
        "promoted": len(promotions), "effective_limit": None if own is None else own.effective_limit,
    }
    until_text = f" until {_when(lapses)}" if lapses else ""
    _done(as_json, result, f"{key}: own limit {limit}{until_text}; {len(promotions)} waiting task(s) promoted")


@keyed.command("clear-key-limit")
@click.argument("key", callback=_key_argument)
@click.option("--reason", default="", help="Why (kept in the audit trail).")
@click.option("--author", default=None, help="Who clears it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def clear_key_limit_command(operator: Operator, key: str, reason: str, author: str | None, as_json: bool) -> None:
    """Remove the limit of KEY's own: its name's limit applies to it again at once (a pause of KEY stays)."""
    author = author if author is not None else _default_author()
    promotions = operator.ledger.clear_key_limit(key, reason=reason, author=author)
    operator.dispatch(promotions or [])
    promoted = len(promotions or [])
    result = {"key": key, "cleared": promotions is not None, "promoted": promoted}
    text = (
        f"{key}: own limit cleared; {promoted} waiting task(s) promoted"
        if promotions is not None
        else f"{key}: no limit of its own to clear (nothing changed)"
    )
    _done(as_json, result, text)


# -- reconcile ---------------------------------------------------------------------------------------------


@keyed.command()
@click.option(
    "--reclaim",
    is_flag=True,
    help="Also reclaim expired leases now (free the slots of claims whose worker stopped renewing them). Use it only "
    "when no worker was cut off from the ledger within the last lease: such a worker may still be running its task "
    "and cannot renew, so its slot would go to a second task. The beat task reclaims only after it has itself "
    "reached the ledger for a full lease, which gives every worker that time to renew or to stop its task.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def reconcile(operator: Operator, reclaim: bool, as_json: bool) -> None:
    """Run one reconcile pass now and print its report: due times, expiries, lapsed overrides, promotions,
    counters checked against the claims that exist (drift is a bug: reported, then repaired), idle keys, finished
    task ids pruned after keyed_books_retention."""
    settings = operator.settings
    ledger = operator.ledger
    if reclaim:
        report = ledger.reconcile(
            idle=settings.idle_key_ttl,
            group_arrival_timeout=settings.group_arrival_timeout,
            reserve_timeout=settings.reserve_timeout,
            books_retention=settings.books_retention,
        )
    else:
        report = ledger.sweep(
            group_arrival_timeout=settings.group_arrival_timeout, reserve_timeout=settings.reserve_timeout
        )
        report.drift += check_counters_once(operator.engine)
        report.dropped_keys = drop_idle_keys_once(operator.engine, idle=settings.idle_key_ttl)
        if settings.books_retention is not None:
            report.pruned = ledger.prune_books(settings.books_retention)
    operator.dispatch(report.promotions)
    summary = _report_summary(report, reclaim=reclaim)
    if as_json:
        _print_json(summary)
        return
    rows = [(k, v) for k, v in summary.items() if k != "drift"]
    click.echo(render_table(("STEP", "RESULT"), rows))
    if report.drift:
        click.echo(f"\nDRIFT repaired ({len(report.drift)}; a bug, please report it):")
        for line in report.drift:
            click.echo(f"  {line}")
    else:
        click.echo("\nno drift: every counter matches the claims and parked rows that exist")


def _report_summary(report: Report, *, reclaim: bool) -> dict[str, Any]:
    return {
        "reclaimed": len(report.reclaimed) if reclaim else "skipped (use --reclaim)",
        "voided": len(report.voided) if reclaim else "skipped (use --reclaim)",
        "due": report.due,
        "expired": report.expired,
        "lost": report.lost,
        "promoted": len(report.promotions),
        "drift": report.drift,
        "dropped_keys": report.dropped_keys,
        "pruned": report.pruned,
    }


# -- migrate -----------------------------------------------------------------------------------------------


@keyed.command("migrate")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def migrate_command(operator: Operator, as_json: bool) -> None:
    """Create or upgrade the ledger's tables (each migration applies exactly once, safe to run concurrently)."""
    from celery_keyed.engine import create_ledger_engine

    # Migrations may take longer than the ledger's statement timeout: none here (connected as every ledger engine).
    engine = create_ledger_engine(operator.settings, statement_timeout=0)
    try:
        applied = migrate(engine)
        with engine.connect() as conn:
            versions = applied_versions(conn)
    finally:
        engine.dispose()
    if as_json:
        _print_json({"applied": applied, "versions": versions})
        return
    if applied:
        click.echo(f"applied {', '.join(applied)}; the ledger is at {versions[-1]}")
    else:
        click.echo(f"the ledger is up to date ({versions[-1] if versions else 'no migrations'})")


# -- inspect -----------------------------------------------------------------------------------------------


@keyed.command("inspect")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1, max=60.0),
    default=1.0,
    show_default=True,
    help="Seconds to wait for the workers' replies.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def inspect_command(ctx: click.Context, timeout: float, as_json: bool) -> None:
    """What each worker's gate holds now (through Celery's remote control, like `celery inspect`): running
    attempts, promotions handed to it that wait for a pool process, tasks held while the ledger is
    unreachable, releases not committed yet."""
    app = _app_of(ctx)
    try:
        replies = app.control.inspect(timeout=timeout)._request("keyed_inspect") or {}
    except Exception as exc:  # the broker's errors are many (kombu, redis, amqp)
        raise click.ClickException(f"could not reach the workers through the broker: {exc}") from None
    if as_json:
        _print_json(replies)
        return
    if not replies:
        click.echo("no worker replied (none running, or none with celery-keyed installed)")
        return
    for worker in sorted(replies):
        reply = replies[worker]
        if "error" in reply:
            click.echo(f"{worker}: {reply['error']}")
            continue
        state = "ledger reachable" if reply["ledger_reachable"] else "LEDGER UNREACHABLE"
        if reply.get("shutting_down"):
            state += ", shutting down"
        click.echo(f"{worker} ({reply['holder']}): {state}, last renewal {reply['last_renewal_ago']:.1f}s ago")
        rows = (
            [
                [
                    "running" if r["started"] else "admitted",
                    r["task"],
                    r["task_id"],
                    r["key"] or "",
                    r["fence"],
                    f"{r['held_for']:.1f}s",
                ]
                for r in reply["running"]
            ]
            + [
                ["handed over", "", p["task_id"], p["key"] or "", p["fence"], f"{p['waiting_for']:.1f}s"]
                for p in reply["handed_over"]
            ]
            + [["held (ledger down)", h["task"], h["task_id"], "", "", ""] for h in reply["held"]]
        )
        if rows:
            click.echo(render_table(["STATE", "TASK", "ID", "KEY", "FENCE", "FOR"], rows, right=(4, 5)))
        if reply["pending_releases"]:
            click.echo(f"  {len(reply['pending_releases'])} release(s) not committed yet (retried by the heartbeat)")
        click.echo("")


# -- weighted fair sharing (issue 14 item 5; ledger/fair_weights.py) -----------------------------------------------


def fair_shares_table(shares: list[FairShare]) -> str:
    """Who holds and waits under each busy key of the fair names: the fair key with the lowest load among those
    waiting gets the key's next free slot."""
    rows = [
        (s.key, "(none)" if s.fair_key is None else s.fair_key, f"{s.weight:g}", s.holding, f"{s.share:.1f}",
         s.waiting, f"{s.load:.2f}")
        for s in shares
    ]
    return "fair shares (next slot: the lowest load that waits)\n" + render_table(
        ("KEY", "FAIR KEY", "WEIGHT", "HOLDS", "SHARE", "WAITING", "LOAD"), rows, right=(2, 3, 4, 5, 6)
    )


@keyed.command("set-weight")
@click.argument("name", callback=_name_argument)
@click.argument("prefix")
@click.argument("weight", type=click.FloatRange(min=FAIR_WEIGHT_MIN, max=FAIR_WEIGHT_MAX))
@click.option("--reason", required=True, help="Why (required; kept in the audit trail).")
@click.option("--expires-in", type=Seconds(), metavar="SECONDS", help="The override lapses after this many seconds.")
@click.option("--until", "until", metavar="ISO", help="The override lapses at this time (ISO 8601; no offset = UTC).")
@click.option("--author", default=None, help="Who sets it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def set_weight(
    operator: Operator,
    name: str,
    prefix: str,
    weight: float,
    reason: str,
    expires_in: float | None,
    until: str | None,
    author: str | None,
    as_json: bool,
) -> None:
    """Give the fair keys of NAME that equal PREFIX or start with PREFIX: the weight WEIGHT at runtime.

    While several fair keys of a key wait, each one's share of the key's slots follows its weight. Wins over the
    tasks' fair_weight and keyed_fair_weights; takes effect at the next promotion, never stops running tasks."""
    if not reason.strip():
        raise click.BadParameter("a reason is required", param_hint="'--reason'")
    expires_at = expiry_of(expires_in, until)
    author = author if author is not None else _default_author()
    config = operator.settings.limits.get(name)
    operator.ledger.set_fair_weight(name, prefix, weight, reason=reason, author=author, expires_at=expires_at)
    result = {
        "name": name,
        "prefix": prefix,
        "weight": weight,
        "reason": reason,
        "author": author,
        "expires_at": expires_at,
        "fair_name": bool(config is not None and config.fair),
    }
    if as_json:
        _print_json(result)
        return
    if not result["fair_name"]:
        click.echo(f"note: {name!r} is not configured fair here: weights only matter for a fair name", err=True)
    until_text = f" until {_when(expires_at)}" if expires_at else ""
    click.echo(f"{name}: fair keys {prefix} weigh {weight:g}{until_text} (from the next promotion on)")


@keyed.command("clear-weight")
@click.argument("name", callback=_name_argument)
@click.argument("prefix")
@click.option("--reason", default="", help="Why (kept in the audit trail).")
@click.option("--author", default=None, help="Who clears it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def clear_weight(operator: Operator, name: str, prefix: str, reason: str, author: str | None, as_json: bool) -> None:
    """Remove the runtime weight of the fair keys PREFIX of NAME: the tasks' weight, else the configured one, else 1,
    applies again from the next promotion on."""
    author = author if author is not None else _default_author()
    cleared = operator.ledger.clear_fair_weight(name, prefix, reason=reason, author=author)
    if as_json:
        _print_json({"name": name, "prefix": prefix, "cleared": cleared})
        return
    if not cleared:
        click.echo(f"{name}: no fair weight override of {prefix} to clear (nothing changed)")
        return
    click.echo(f"{name}: fair weight override of {prefix} cleared")


@keyed.command("weights")
@click.option("--name", "name", metavar="NAME", help="Only this name.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def weights(operator: Operator, name: str | None, as_json: bool) -> None:
    """The fair weights: configured (keyed_fair_weights) and live runtime overrides."""
    with operator.engine.connect() as conn:
        overrides = [dict(r._mapping) for r in fair_weight_overrides(conn, name)]
    configured = {
        n: dict(c.fair_weights or {})
        for n, c in sorted(operator.settings.limits.items())
        if c.fair and (name is None or n == name)
    }
    if as_json:
        _print_json({"configured": configured, "overrides": overrides})
        return
    rows = [(n, prefix, f"{w:g}", "config", "", "") for n, table in configured.items() for prefix, w in table.items()]
    rows += [
        (o["name"], o["prefix"], f"{o['weight']:g}", "override", o["reason"], _when(o["expires_at"]))
        for o in overrides
    ]
    if not rows:
        click.echo("no fair weights: every fair key weighs what its tasks carry, else 1")
        return
    click.echo(render_table(("NAME", "PREFIX", "WEIGHT", "SOURCE", "REASON", "EXPIRES"), rows, right=(2,)))
