"""How the command line publishes what a ledger change promoted: one function, so one policy for the whole CLI.

Every write that can promote waiting tasks (set-limit, clear-limit, resume-key, set-key-limit, clear-key-limit,
reconcile) hands its promotions here and nowhere else; replacing this function replaces the CLI's dispatch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import click

from celery_keyed.access import dispatch
from celery_keyed.ledger import Promotion


def publish_promotions(app: Any, promotions: Iterable[Promotion], *, dispatch_timeout: float) -> int:
    """Publish promoted attempts with their admission nonce (``access.dispatch``, as the beat task does); returns how
    many failed.

    The ledger change is committed already: a promotion that cannot be published stays in the ledger and goes back
    in line after ``keyed_dispatch_timeout``, so a broker error is a warning on stderr, not a failure of the
    command."""
    done = dispatch(app, list(promotions))
    if done.failed:
        click.echo(
            f"warning: {len(done.failed)} promoted task(s) could not be published ({done.error}); they go back in"
            f" line after keyed_dispatch_timeout ({dispatch_timeout:g}s)",
            err=True,
        )
    return len(done.failed)
