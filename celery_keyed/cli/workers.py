"""``celery keyed inspect``: what each worker's gate holds now, asked through Celery's remote control."""

from __future__ import annotations

import click

from celery_keyed.cli.operator import app_of
from celery_keyed.cli.render import print_json, render_table


@click.command("inspect")
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
    app = app_of(ctx)
    try:
        replies = app.control.inspect(timeout=timeout)._request("keyed_inspect") or {}
    except Exception as exc:  # the broker's errors are many (kombu, redis, amqp)
        raise click.ClickException(f"could not reach the workers through the broker: {exc}") from None
    if as_json:
        print_json(replies)
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

