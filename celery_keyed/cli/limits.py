"""Limits and pauses at runtime, each change kept in the audit trail: a name's limit (set-limit, clear-limit), one
key's pause or own limit (pause-key, resume-key, set-key-limit, clear-key-limit), and the weights of a fair name's
fair keys (set-weight, clear-weight, weights). A change that frees slots promotes waiting tasks at once."""

from __future__ import annotations

import click

from celery_keyed.cli.operator import (
    Operator,
    Seconds,
    default_author,
    expiry_of,
    key_argument,
    name_argument,
    pass_operator,
    required_reason,
)
from celery_keyed.cli.render import done, print_json, render_table, when
from celery_keyed.ledger import (
    FAIR_WEIGHT_MAX,
    FAIR_WEIGHT_MIN,
    SLOT_LIMIT_MAX,
    Promotion,
    fair_weight_overrides,
    override_get,
    status_names,
)


@click.command("set-limit", context_settings={"ignore_unknown_options": True})  # "-1" is a bad N, not an option
@click.argument("name", callback=name_argument)
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
    author = author if author is not None else default_author()
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
        print_json(result)
        return
    if not known:
        click.echo(
            f"note: {name!r} is not in keyed_concurrency_limits and the ledger has seen no {name}:* key; "
            "the override applies to any such key from now on",
            err=True,
        )
    was = f"was {result['previous_limit']} ({result['previous_source']})"
    what = "paused" if limit == 0 else f"limit {limit}"
    until_text = f" until {when(expires_at)}" if expires_at else ""
    click.echo(f"{name}: {what}{until_text}, {was}; {len(promotions)} waiting task(s) promoted")


@click.command("clear-limit")
@click.argument("name", callback=name_argument)
@click.option("--reason", default="", help="Why (kept in the audit trail).")
@click.option("--author", default=None, help="Who clears it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def clear_limit(operator: Operator, name: str, reason: str, author: str | None, as_json: bool) -> None:
    """Remove the runtime override of NAME: its configured limit (or 1) applies again at once."""
    author = author if author is not None else default_author()
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
        print_json(result)
        return
    if existing is None:
        click.echo(f"{name}: no override to clear (nothing changed); limit {now_limit} ({now_source})")
        return
    click.echo(
        f"{name}: override {existing.slot_limit} cleared; limit {now_limit} ({now_source}); "
        f"{len(promotions)} waiting task(s) promoted"
    )



@click.command("pause-key")
@click.argument("key", callback=key_argument)
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
    required_reason(reason)
    if (seconds is None) == (until is None):
        raise click.UsageError("give --for SECONDS or --until ISO (one of the two)")
    author = author if author is not None else default_author()
    paused_until, changed = operator.ledger.pause_key(
        key, seconds, until=expiry_of(None, until), reason=reason, author=author
    )
    result = {"key": key, "paused_until": paused_until, "changed": changed, "reason": reason, "author": author}
    text = (
        f"{key}: paused until {when(paused_until)}"
        if changed
        else f"{key}: already paused until {when(paused_until)} (a pause is only extended; nothing changed)"
    )
    done(as_json, result, text)


@click.command("resume-key")
@click.argument("key", callback=key_argument)
@click.option("--reason", default="", help="Why (kept in the audit trail).")
@click.option("--author", default=None, help="Who resumes it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def resume_key_command(operator: Operator, key: str, reason: str, author: str | None, as_json: bool) -> None:
    """End the pause of KEY now: its waiting tasks start (as its limit allows)."""
    author = author if author is not None else default_author()
    promotions = operator.ledger.resume_key(key, reason=reason, author=author)
    operator.dispatch(promotions or [])
    promoted = len(promotions or [])
    result = {"key": key, "resumed": promotions is not None, "promoted": promoted}
    text = (
        f"{key}: resumed; {promoted} waiting task(s) promoted"
        if promotions is not None
        else f"{key}: not paused (nothing changed)"
    )
    done(as_json, result, text)


@click.command("set-key-limit", context_settings={"ignore_unknown_options": True})  # "-1" is a bad N
@click.argument("key", callback=key_argument)
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
    required_reason(reason)
    if expires_in is not None and until is not None:
        raise click.UsageError("give --expires-in or --until, not both")
    author = author if author is not None else default_author()
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
    until_text = f" until {when(lapses)}" if lapses else ""
    done(as_json, result, f"{key}: own limit {limit}{until_text}; {len(promotions)} waiting task(s) promoted")


@click.command("clear-key-limit")
@click.argument("key", callback=key_argument)
@click.option("--reason", default="", help="Why (kept in the audit trail).")
@click.option("--author", default=None, help="Who clears it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def clear_key_limit_command(operator: Operator, key: str, reason: str, author: str | None, as_json: bool) -> None:
    """Remove the limit of KEY's own: its name's limit applies to it again at once (a pause of KEY stays)."""
    author = author if author is not None else default_author()
    promotions = operator.ledger.clear_key_limit(key, reason=reason, author=author)
    operator.dispatch(promotions or [])
    promoted = len(promotions or [])
    result = {"key": key, "cleared": promotions is not None, "promoted": promoted}
    text = (
        f"{key}: own limit cleared; {promoted} waiting task(s) promoted"
        if promotions is not None
        else f"{key}: no limit of its own to clear (nothing changed)"
    )
    done(as_json, result, text)



@click.command("set-weight")
@click.argument("name", callback=name_argument)
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
    author = author if author is not None else default_author()
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
        print_json(result)
        return
    if not result["fair_name"]:
        click.echo(f"note: {name!r} is not configured fair here: weights only matter for a fair name", err=True)
    until_text = f" until {when(expires_at)}" if expires_at else ""
    click.echo(f"{name}: fair keys {prefix} weigh {weight:g}{until_text} (from the next promotion on)")


@click.command("clear-weight")
@click.argument("name", callback=name_argument)
@click.argument("prefix")
@click.option("--reason", default="", help="Why (kept in the audit trail).")
@click.option("--author", default=None, help="Who clears it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def clear_weight(operator: Operator, name: str, prefix: str, reason: str, author: str | None, as_json: bool) -> None:
    """Remove the runtime weight of the fair keys PREFIX of NAME: the tasks' weight, else the configured one, else 1,
    applies again from the next promotion on."""
    author = author if author is not None else default_author()
    cleared = operator.ledger.clear_fair_weight(name, prefix, reason=reason, author=author)
    if as_json:
        print_json({"name": name, "prefix": prefix, "cleared": cleared})
        return
    if not cleared:
        click.echo(f"{name}: no fair weight override of {prefix} to clear (nothing changed)")
        return
    click.echo(f"{name}: fair weight override of {prefix} cleared")


@click.command("weights")
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
        print_json({"configured": configured, "overrides": overrides})
        return
    rows = [(n, prefix, f"{w:g}", "config", "", "") for n, table in configured.items() for prefix, w in table.items()]
    rows += [
        (o["name"], o["prefix"], f"{o['weight']:g}", "override", o["reason"], when(o["expires_at"]))
        for o in overrides
    ]
    if not rows:
        click.echo("no fair weights: every fair key weighs what its tasks carry, else 1")
        return
    click.echo(render_table(("NAME", "PREFIX", "WEIGHT", "SOURCE", "REASON", "EXPIRES"), rows, right=(2,)))
