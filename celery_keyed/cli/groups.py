"""A held group's operator actions (a group whose name's ``group_failure`` is ``hold``, after its head failed):
resume-group (the group goes on: the failed head's retry runs, or the next number) and skip-group-head (the failed
head is dead-lettered, the next number starts). Each is recorded as a ledger event; what it promotes is published
at once. ``celery keyed status`` lists the held groups, ``celery keyed explain`` says why a member waits."""

from __future__ import annotations

import click

from celery_keyed.cli.operator import Operator, default_author, key_argument, pass_operator
from celery_keyed.cli.render import done


@click.command("resume-group")
@click.argument("group_key", callback=key_argument)
@click.option("--reason", default="", help="Why (kept with the ledger's event).")
@click.option("--author", default=None, help="Who resumes it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def resume_group_command(operator: Operator, group_key: str, reason: str, author: str | None, as_json: bool) -> None:
    """End the hold of GROUP_KEY: its failed head's retry runs (or, when that head ended for good, the next task)."""
    author = author if author is not None else default_author()
    action = operator.ledger.resume_group(group_key, reason=reason, author=author)
    promotions = [] if action is None else action.promotions
    operator.dispatch(promotions)
    result = {
        "group_key": group_key, "resumed": action is not None,
        "failed_head": None if action is None else action.task_id, "promoted": len(promotions),
    }
    text = (
        f"{group_key}: not held (nothing changed)"
        if action is None
        else f"{group_key}: resumed (its head {action.task_id} had failed); {len(promotions)} task(s) promoted"
    )
    done(as_json, result, text)


@click.command("skip-group-head")
@click.argument("group_key", callback=key_argument)
@click.option("--reason", default="", help="Why (kept with the ledger's event).")
@click.option("--author", default=None, help="Who skips it (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@pass_operator
def skip_group_head_command(
    operator: Operator, group_key: str, reason: str, author: str | None, as_json: bool
) -> None:
    """Dead-letter the failed head of held GROUP_KEY and end the hold: the next task of the group starts."""
    author = author if author is not None else default_author()
    action = operator.ledger.skip_group_head(group_key, reason=reason, author=author)
    promotions = [] if action is None else action.promotions
    operator.dispatch(promotions)
    result = {
        "group_key": group_key, "held": action is not None,
        "failed_head": None if action is None else action.task_id,
        "dead_lettered": action is not None and action.skipped, "promoted": len(promotions),
    }
    if action is None:
        text = f"{group_key}: not held (nothing changed)"
    else:
        what = "dead-lettered" if action.skipped else "had ended already"
        text = f"{group_key}: its failed head {action.task_id} {what}; {len(promotions)} task(s) promoted"
    done(as_json, result, text)
