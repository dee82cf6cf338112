"""Keeping the ledger in shape: ``migrate`` (create or upgrade its tables), ``reconcile`` (one pass of the repairs
the beat task runs: due times, expiries, lapsed overrides, promotions, counters, idle keys, old books) and
``drop-ledger`` (remove its tables when celery-keyed leaves a project)."""

from __future__ import annotations

from typing import Any

import click

from celery_keyed.cli.operator import Operator, pass_operator
from celery_keyed.cli.render import print_json, render_table
from celery_keyed.ledger import (
    LedgerInUse,
    Report,
    applied_versions,
    check_counters_once,
    drop_idle_keys_once,
    drop_ledger,
    ledger_objects,
    migrate,
)


@click.command()
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
        print_json(summary)
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


@click.command("migrate")
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
        print_json({"applied": applied, "versions": versions})
        return
    if applied:
        click.echo(f"applied {', '.join(applied)}; the ledger is at {versions[-1]}")
    else:
        click.echo(f"the ledger is up to date ({versions[-1] if versions else 'no migrations'})")



# -- drop-ledger -------------------------------------------------------------------------------------------


@click.command("drop-ledger")
@click.option(
    "--yes", is_flag=True, help="Drop them (without it nothing is dropped: the command says what it would drop)."
)
@click.option(
    "--force",
    is_flag=True,
    help="Drop them even while tasks wait in the ledger or slots are held: the waiting tasks are lost (their messages "
    "live only in the ledger).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def drop_ledger_command(operator: Operator, yes: bool, force: bool, as_json: bool) -> None:
    """Remove the ledger's tables, functions and sequences from its database (removing celery-keyed from a project:
    stop the workers' gate first). Refuses while tasks wait in the ledger or slots are held, unless --force; drops
    nothing without --yes. Objects of other names are never touched."""
    from celery_keyed.engine import create_ledger_engine

    if not yes:
        objects = ledger_objects()
        count = sum(len(names) for names in objects.values())
        raise click.ClickException(
            f"nothing dropped: this removes the ledger's {count} tables, functions and sequences (every task "
            "waiting in it with them); run it again with --yes"
        )
    engine = create_ledger_engine(operator.settings, statement_timeout=0)
    try:
        dropped = drop_ledger(engine, force=force)
    except LedgerInUse as exc:
        raise click.ClickException(f"nothing dropped: {exc} (--force)") from None
    finally:
        engine.dispose()
    if as_json:
        print_json({"dropped": dropped})
        return
    click.echo(f"dropped {len(dropped)} objects of the ledger" if dropped else "the ledger has no objects to drop")
