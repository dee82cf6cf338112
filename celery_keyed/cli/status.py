"""``celery keyed status``: names and keys, their limits and where they come from, in flight, waiting, the rules
that refuse or expire tasks, key overrides, fair shares, held groups, the workers' configuration versions, sends and
the outbox.

One aggregated query per table, so it stays fast on 100,000 keys."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import click

from celery_keyed.cli.operator import Operator, Seconds, name_option, pass_operator
from celery_keyed.cli.render import age, print_json, render_table, when
from celery_keyed.ledger import (
    INT_MAX,
    STATEMENT_TIMEOUT_MAX,
    FairShare,
    GroupHold,
    KeyOverride,
    KeyStatus,
    NameStatus,
    fair_shares,
    held_groups,
    holders_latest,
    key_overrides_live,
    names_newest_version,
    outbox_by_name,
    rate_text,
    sent_by_name,
    status_key_count,
    status_keys,
    status_names,
    status_now,
    status_prepare,
    window_length_text,
    window_text,
)
from celery_keyed.settings import KeyedSettings


@dataclass
class Readings:
    """What one status report read, in one transaction."""

    at: datetime
    names: list[NameStatus]
    keys: list[KeyStatus]
    keys_total: int
    newest: int
    workers: list[dict[str, Any]]
    sends: list[Any]
    outbox: list[Any]
    key_overrides: list[KeyOverride]
    shares: list[FairShare]
    held: list[GroupHold]


def read_status(operator: Operator, name: str | None, limit: int, idle: bool, timeout: float) -> Readings:
    with operator.engine.begin() as conn:
        status_prepare(conn, timeout=timeout)
        return Readings(
            at=status_now(conn),
            names=status_names(conn, name=name),
            keys=status_keys(conn, name=name, limit=limit, idle=idle) if limit else [],
            keys_total=status_key_count(conn, name=name),
            newest=names_newest_version(conn),
            workers=[dict(r._mapping) for r in holders_latest(conn)],
            sends=[s for s in sent_by_name(conn) if name is None or s.name == name],
            outbox=[o for o in outbox_by_name(conn) if name is None or o.name == name],
            key_overrides=key_overrides_live(conn, name=name),  # a key's own pause or limit
            shares=fair_shares(conn, name=name, limit=max(limit, 1) * 10) if limit else [],
            held=[g for g in held_groups(conn) if name is None or g.group_key.partition(":")[0] == name],
        )


@click.command()
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
    """Names and keys: limit and where it comes from (override, config, default), the rules that refuse or expire
    tasks (max_waiting, max_wait, shards, rate), in flight, waiting, oldest wait.

    One aggregated query per table, so it stays fast on 100,000 keys; keys are the busiest N
    (most waiting, then most in flight)."""
    name = name_option(name)
    seen = read_status(operator, name, limit, idle, timeout)
    notes = config_notes(operator.settings, seen.names, name) + version_notes(
        operator.settings, seen.newest, seen.workers
    )
    if as_json:
        print_json(
            {
                "at": seen.at,
                "names": [n.as_dict() for n in seen.names],
                "keys": [k.as_dict() for k in seen.keys],
                "keys_total": seen.keys_total,
                "config_version": seen.newest,
                "workers": seen.workers,
                "sends": [s.as_dict() for s in seen.sends],
                "outbox": [o.as_dict() for o in seen.outbox],
                "key_overrides": [k.as_dict() for k in seen.key_overrides],
                "fair_shares": [f.as_dict() for f in seen.shares],
                "held_groups": [g.as_dict() for g in seen.held],
                "notes": notes,
            }
        )
        return
    click.echo("\n\n".join(status_sections(seen, name=name, limit=limit, idle=idle)))
    for note in notes:
        click.echo(f"note: {note}", err=True)


def status_sections(seen: Readings, *, name: str | None, limit: int, idle: bool) -> list[str]:
    """The human report, one block of text per section that has something to show."""
    sections = [
        names_table(seen.names) if seen.names else "no names: the ledger has no configured name, override or key yet"
    ]
    told = rules_in_words(seen.names)
    if told:
        sections.append("\n".join(told))
    if limit:
        busy = sum(n.busy_keys for n in seen.names)
        shown = f"{len(seen.keys)} of " + (f"{seen.keys_total} keys shown" if idle else f"{busy} busy keys shown")
        summary = f"({shown}; {seen.keys_total} keys in the ledger" + (f" for {name})" if name else ")")
        sections.append((keys_table(seen.keys) + "\n" if seen.keys else "") + summary)
    if seen.key_overrides:
        sections.append(key_overrides_table(seen.key_overrides))
    if seen.shares:
        sections.append(fair_shares_table(seen.shares))
    if seen.held:
        sections.append(held_groups_table(seen.held))
    if seen.workers:
        sections.append(f"configuration version stored: {seen.newest}\n" + workers_table(seen.workers, seen.newest))
    if seen.sends:
        sections.append(sends_table(seen.sends))
    if seen.outbox:
        sections.append(outbox_table(seen.outbox))
    return sections


def config_notes(settings: KeyedSettings, names: list[NameStatus], only: str | None) -> list[str]:
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


def version_notes(settings: KeyedSettings, newest: int, workers: list[dict[str, Any]]) -> list[str]:
    """Rolling deploys: workers whose latest start runs an older configuration version than the one stored, and this
    app's own version when it is older."""
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


def workers_table(workers: list[dict[str, Any]], newest: int) -> str:
    rows = [
        (
            w["hostname"],
            w["pid"],
            when(w["started_at"]),
            "-" if w["config_version"] is None else w["config_version"],
            "older" if w["config_version"] is not None and w["config_version"] < newest else "",
            w["claims"],
        )
        for w in workers
    ]
    return render_table(("WORKER", "PID", "STARTED", "CONFIG VERSION", "", "CLAIMS"), rows, right=(1, 3, 5))


def sends_table(sends: list[Any]) -> str:
    rows = [(s.name, s.in_flight, s.refused_full, s.refused_duplicate) for s in sends]
    return render_table(
        ("NAME", "SENT NOT ARRIVED", "REFUSED ROOM FULL", "REFUSED DUPLICATE"), rows, right=(1, 2, 3)
    )


def outbox_table(outbox: list[Any]) -> str:
    """Registered at publish and not received yet, per name."""
    rows = [
        (o.name, o.not_received, o.pending, o.republished_tasks, o.republished, when(o.oldest))
        for o in outbox
    ]
    return render_table(
        ("NAME", "REGISTERED NOT RECEIVED", "NOT PUBLISHED YET", "REPUBLISHED TASKS", "REPUBLISHES", "OLDEST"),
        rows,
        right=(1, 2, 3, 4),
    )


def override_note(n: NameStatus) -> str:
    """The OVERRIDE cell of a name: its runtime override (who, until when, why) and its keys' own overrides."""
    note = ""
    if n.source == "override":
        note = ("PAUSED " if n.paused else "") + f"by {n.override_author or '?'}"
        if n.override_expires_at is not None:
            note += f" until {when(n.override_expires_at)}"
        if n.configured_limit is not None:
            note += f" (config {n.configured_limit})"
        note += f": {n.override_reason}"
    elif n.paused:
        note = "PAUSED"
    if n.paused_keys or n.limited_keys:
        note = "; ".join(x for x in (note, key_overrides_note(n)) if x)
    return note


def names_table(names: list[NameStatus]) -> str:
    rows = []
    for n in names:
        waiting = f"{n.waiting} ({n.debounced} debounced)" if n.debounced else n.waiting
        rows.append(
            (n.name, n.limit, n.source, rules(n), n.keys, n.in_flight, waiting, age(n.oldest_waiting_age),
             override_note(n))
        )
    return render_table(
        ("NAME", "LIMIT", "SOURCE", "RULES", "KEYS", "IN FLIGHT", "WAITING", "OLDEST WAIT", "OVERRIDE"),
        rows,
        right=(1, 4, 5, 6, 7),
    )


def rules(n: NameStatus) -> str:
    """A name's rules besides its limit, as its settings name them: the waiting room (max_waiting, and "supersede"
    when a full one replaces its oldest), max_wait, shards, rate (with burst), fair sharing, uncertain hold; "-"
    when none."""
    found = []
    if n.max_waiting is not None:
        found.append(f"max_waiting {n.max_waiting}" + (" supersede" if n.overflow == "supersede" else ""))
    if n.max_wait is not None:
        found.append(f"max_wait {n.max_wait:g}s")
    if n.shards > 1:
        found.append(f"shards {n.shards}")
    if n.rate is not None:
        found.append(f"rate {rate_text(n.rate)}" + (f" burst {n.burst:g}" if n.burst else ""))
    if n.windows:
        found.append("windows " + " ".join(window_text(c, t) for c, t in n.windows))
    if n.cap is not None:
        found.append(f"cap {n.cap}" + (" borrow" if n.borrow else ""))
    if n.fair:
        found.append("fair")
    if n.uncertain_hold:
        found.append(f"uncertain {n.uncertain_hold:g}s")
    if n.group_failure != "halt":
        found.append(f"group_failure {n.group_failure}")
    return ", ".join(found) or "-"


def rules_in_words(names: list[NameStatus]) -> list[str]:
    """One sentence per name whose rules refuse, replace, expire or slow tasks down: what happens to a task of it."""
    lines = []
    for n in names:
        said = []
        if n.max_waiting is not None:
            full = (
                "a new arrival replaces the oldest waiting task"
                if n.overflow == "supersede"
                else "a new arrival is rejected"
            )
            tasks = "1 task of a key waits" if n.max_waiting == 1 else f"{n.max_waiting} tasks of a key wait"
            said.append(f"once {tasks}, {full}")
        if n.max_wait is not None:
            said.append(f"a task that has not started {n.max_wait:g}s after it arrived expires")
        if n.rate is not None:
            burst = f" (saving up at most {n.burst:g})" if n.burst and n.burst > 1 else ""
            said.append(f"each key starts at most {rate_text(n.rate)}{burst}")
        if n.windows:
            parts = [f"{c} in any {window_length_text(t)}" for c, t in n.windows]
            counts = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
            said.append(f"each key starts at most {counts}")
        if n.cap is not None:
            borrow = f"; a key may run up to {n.cap} while no task waits for that room" if n.borrow else ""
            said.append(f"its keys together run at most {n.cap}{borrow}")
        if n.shards > 1:
            said.append(f"each key's limit is spread over {n.shards} shards")
        if n.group_failure in GROUP_FAILURE_WORDS:
            said.append(GROUP_FAILURE_WORDS[n.group_failure])
        if said:
            lines.append(f"{n.name}: " + "; ".join(said) + ".")
    return lines


#: What a group whose policy is not the default does when its head fails, in words.
GROUP_FAILURE_WORDS = {
    "skip": "a group head that fails is dead-lettered at once (no retry) and its group moves on",
    "hold": "a group head that fails holds its group until an operator resumes it or skips the head",
}


def held_groups_table(held: list[GroupHold]) -> str:
    """The groups held for an operator, with the head that held them and why, and what to run."""
    rows = [(g.group_key, when(g.held_since), g.task_id, g.members, g.reason) for g in held]
    table = render_table(["held group", "since", "failed head", "members", "why"], rows)
    return (table + "\nnothing of a held group starts until: celery keyed resume-group GROUP_KEY"
            " (its head runs again or the next one starts) or celery keyed skip-group-head GROUP_KEY"
            " (the failed head is dead-lettered)")


def keys_table(keys: list[KeyStatus]) -> str:
    rows = [(k.key, k.limit, k.source, k.in_flight, k.waiting, age(k.oldest_waiting_age)) for k in keys]
    return render_table(("KEY", "LIMIT", "SOURCE", "IN FLIGHT", "WAITING", "OLDEST WAIT"), rows, right=(1, 3, 4, 5))


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
            "-" if o.paused_until is None else when(o.paused_until),
            "-" if o.paused_until is None else f"{o.pause_reason} ({o.pause_author or '?'})",
            "-" if o.slot_limit is None else o.slot_limit,
            "-" if o.slot_limit is None else when(o.expires_at) if o.expires_at else "until cleared",
            "-" if o.slot_limit is None else f"{o.reason} ({o.author or '?'})",
        )
        for o in overrides
    ]
    return "key overrides (a key's own pause or limit; a paused name pauses every key)\n" + render_table(
        ("KEY", "LIMIT NOW", "PAUSED UNTIL", "PAUSE REASON", "OWN LIMIT", "LIMIT UNTIL", "LIMIT REASON"),
        rows,
        right=(1, 4),
    )


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
