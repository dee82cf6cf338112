"""``celery keyed explain TASK_ID``: why a task is (not) running, in sentences an operator reads.

The ledger's ``explain`` gives a state, a sentence and the facts; this module turns the facts of the common states
(running, promoted, waiting in a key's line, finished) into sentences — which worker runs it and since when, how many
of the key's slots are in use, how many tasks wait ahead, when it expires — and says the ledger's own sentence for the
rest. ``--json`` prints every fact for scripts. A task id the ledger has no record of exits 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import click

from celery_keyed.cli.operator import Operator, pass_operator
from celery_keyed.cli.render import print_json, when
from celery_keyed.ledger import Explanation

Facts = Mapping[str, Any]


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def worker_of(holder: str | None) -> str:
    """``worker celery@host (pid 1234)`` from a holder id (``hostname:pid:token``, see ``new_holder``)."""
    if not holder:
        return "a worker"
    parts = holder.rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit():
        return f"worker {parts[0]} (pid {parts[1]})"
    return f"worker {holder}"


def slots_in_use(facts: Facts) -> str:
    """``2 of 3 slots of account:42 in use`` (and what this task holds when it is more than one slot)."""
    key, in_flight, limit = facts.get("key"), facts.get("in_flight"), facts.get("k")
    if key is None:
        return f"group {facts.get('group_key')}"
    extra = list(facts.get("extra_keys") or [])
    used = f"{in_flight} of {plural(int(limit), 'slot')} of {key} in use" if limit is not None else f"key {key}"
    if facts.get("mode") == "exclusive":
        return f"alone on {key}: it holds all of its slots"
    if extra:
        used += f"; it also holds a slot of {', '.join(extra)}"
    cost = facts.get("cost") or 1
    if cost > 1:
        used += f"; {cost} of them are this task's"
    return used


def running(facts: Facts, _text: str) -> list[str]:
    lines = [
        f"running on {worker_of(facts.get('holder'))} since {when(facts.get('claimed_at'))} ({slots_in_use(facts)})",
        f"attempt {facts.get('attempt')}, fence {facts.get('fence')}: its lease runs"
        f" {max(float(facts.get('lease_left') or 0), 0.0):.1f}s more and the worker renews it while it runs"
        " (if the worker is lost, the slot comes back when the lease ends)",
    ]
    if facts.get("cancel_requested_at") is not None:
        lines.append(
            f"its worker is stopping it: cancel requested at {when(facts['cancel_requested_at'])}"
            f" ({facts.get('cancel_detail')})"
        )
    return lines


def promoted(facts: Facts, _text: str) -> list[str]:
    return [
        f"given a slot at {when(facts.get('claimed_at'))} ({slots_in_use(facts)}) and on its way to a worker",
        f"if no worker starts it by {when(facts.get('dispatch_deadline'))}, it goes back in line",
    ]


def waiting(facts: Facts, text: str) -> list[str]:
    """A task in one key's line (not fair, not multi-key: the ledger's own sentence says those best)."""
    key = facts.get("key")
    if key is None or facts.get("keys") or facts.get("fair"):
        return [text, *parked(facts)]
    ahead = int(facts.get("ahead") or 0)
    use = f"{facts.get('in_flight')} of {plural(int(facts.get('k') or 0), 'slot')} in use"
    line = f"waiting behind {plural(ahead, 'task')} of {key} ({use})" if ahead else f"next in line for {key} ({use})"
    lines = [line]
    if facts.get("mode") == "exclusive":
        lines.append("it runs alone (exclusive): it starts when nothing of the key runs")
    own = facts.get("key_override") or {}
    if own.get("slot_limit") is not None:
        until = f" until {when(own['expires_at'])}" if own.get("expires_at") else ""
        lines.append(f"the key has a limit of its own, {own['slot_limit']}{until} ({own.get('reason')})")
    return lines + parked(facts)


def parked(facts: Facts) -> list[str]:
    """What every parked task shares: when it arrived, its priority, when it expires if it has not started."""
    lines = []
    if isinstance(facts.get("arrived_at"), datetime):
        lines.append(f"it arrived at {when(facts['arrived_at'])} (attempt {facts.get('attempt')})")
    if facts.get("priority"):
        lines.append(f"priority {facts['priority']}: it goes before the key's tasks of lower priority")
    if isinstance(facts.get("deadline"), datetime):
        lines.append(f"it expires at {when(facts['deadline'])} if it has not started by then")
    return lines


def finished(facts: Facts, text: str) -> list[str]:
    lines = [text]
    if isinstance(facts.get("arrived_at"), datetime):
        lines.append(f"it arrived at {when(facts['arrived_at'])}; its outcome is kept for keyed_books_retention")
    return lines


def told(facts: Facts, text: str) -> list[str]:
    """The ledger's sentence (and, for a parked task, when it arrived and expires)."""
    return [text, *parked(facts)] if "shadow" in facts else [text]


SENTENCES: dict[str, Callable[[Facts, str], list[str]]] = {
    "running": running,
    "promoted": promoted,
    "waiting": waiting,
    "finished": finished,
}


def sentences(explanation: Explanation) -> list[str]:
    """What ``explain`` prints under the task's id and state: one sentence a line."""
    return SENTENCES.get(explanation.state, told)(explanation.facts, explanation.text)


@click.command()
@click.argument("task_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts (every fact).")
@pass_operator
def explain(operator: Operator, task_id: str, as_json: bool) -> None:
    """Why task TASK_ID is (not) running, in words: which worker runs it and since when, how many tasks wait ahead of
    it, what holds it back. Exits 1 when the ledger has no record of it (state "unknown"), after saying so."""
    if not task_id.strip():
        raise click.BadParameter("a task id cannot be blank", param_hint="'TASK_ID'")
    explanation = operator.ledger.explain(task_id)
    if as_json:
        print_json(
            {
                "task_id": explanation.task_id,
                "state": explanation.state,
                "text": explanation.text,
                "facts": explanation.facts,
            }
        )
    else:
        click.echo(f"{explanation.task_id}: {explanation.state}")
        for line in sentences(explanation):
            click.echo(f"  {line}")
    if explanation.state == "unknown":
        raise click.exceptions.Exit(1)
