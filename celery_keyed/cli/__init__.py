"""``celery keyed``: the operator's command line (registered through the ``celery.commands`` entry point as
``celery_keyed.cli:keyed``).

    celery -A proj keyed status [--name NAME] [--limit N] [--all] [--json]
    celery -A proj keyed explain TASK_ID [--json]
    celery -A proj keyed inspect [--timeout SECONDS] [--json]
    celery -A proj keyed set-limit NAME N --reason TEXT [--expires-in SECONDS | --until ISO] [--author WHO]
    celery -A proj keyed clear-limit NAME [--reason TEXT] [--author WHO]
    celery -A proj keyed pause-key / resume-key / set-key-limit / clear-key-limit KEY ...
    celery -A proj keyed set-weight / clear-weight NAME PREFIX ... ; celery -A proj keyed weights
    celery -A proj keyed resume-group / skip-group-head GROUP_KEY [--reason TEXT] [--author WHO]
    celery -A proj keyed reconcile [--reclaim] [--json]
    celery -A proj keyed migrate [--json]
    celery -A proj keyed drop-ledger --yes [--force] [--json]

Every subcommand reads the ledger from the app's ``keyed_database_url``. Reads go through the ledger's status and
explain views; writes through the ledger's own functions (overrides with their audit rows, reconcile, migrate).
Bad input is a click error (exit 2) and changes nothing; a ledger that cannot be reached or has no schema is an
error too (exit 1). ``--json`` prints one JSON document for scripts.

The package follows what an operator does:

- ``status``, ``explain``, ``workers`` (``inspect``): look (nothing here writes);
- ``limits``: change limits, pauses and fair weights at runtime;
- ``groups``: resume a held group, or skip its failed head;
- ``maintenance``: ``migrate``, ``reconcile`` and ``drop-ledger``;
- ``operator`` (what every command shares), ``render`` (tables, JSON, times), ``dispatch`` (how the commands publish
  what a write promoted: one function).
"""

from __future__ import annotations

import click

from celery_keyed.cli.explain import explain
from celery_keyed.cli.groups import resume_group_command, skip_group_head_command
from celery_keyed.cli.limits import (
    clear_key_limit_command,
    clear_limit,
    clear_weight,
    pause_key_command,
    resume_key_command,
    set_key_limit_command,
    set_limit,
    set_weight,
    weights,
)
from celery_keyed.cli.maintenance import drop_ledger_command, migrate_command, reconcile
from celery_keyed.cli.operator import Operator, expiry_of
from celery_keyed.cli.render import render_table
from celery_keyed.cli.status import fair_shares_table, key_overrides_note, key_overrides_table, status
from celery_keyed.cli.workers import inspect_command

__all__ = [
    "Operator",
    "expiry_of",
    "fair_shares_table",
    "key_overrides_note",
    "key_overrides_table",
    "keyed",
    "render_table",
]


@click.group(name="keyed")
def keyed() -> None:
    """celery-keyed: see and steer the slot ledger (limits, keys, waiting tasks)."""


for command in (
    status,
    explain,
    inspect_command,
    set_limit,
    clear_limit,
    pause_key_command,
    resume_key_command,
    set_key_limit_command,
    clear_key_limit_command,
    set_weight,
    clear_weight,
    weights,
    resume_group_command,
    skip_group_head_command,
    reconcile,
    migrate_command,
    drop_ledger_command,
):
    keyed.add_command(command)
