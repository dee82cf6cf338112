"""Group failure policies with real workers (docs/groups.md): two prefork workers, one group name per policy, and the
independent observer (each body writes its start and its end or failure, tests/acceptance/group_policy_tasks.py).
Order is kept under every policy (one member of a group at a time, in publish order); ``halt`` waits for its head's
retry, ``skip`` dead-letters the head that asks for one and goes on at once, ``hold`` starts nothing until the
operator resumes the group (the failed head's retry runs first) or skips its head (the next member runs). The books
balance: every member ends with exactly one outcome."""

from __future__ import annotations

import json
from typing import Any

import pytest
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_keyed.cli import keyed
from celery_keyed.exceptions import KeyedDeadLettered
from tests.acceptance.conftest import Cluster, peak_overlap

LIMITS = {"halt": {"group_failure": "halt"}, "skip": {"group_failure": "skip"}, "hold": {"group_failure": "hold"}}
WAIT = 120.0


def operator(app: Any, *args: str) -> Any:
    """``celery keyed ...`` as an operator types it (it publishes what it promotes)."""
    result = CliRunner().invoke(keyed, [*args, "--json"], obj=CLIContext(app=app, no_color=True, workdir=None))
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def starts(cluster: Cluster, group: str) -> list[str]:
    """The notes ("<seq>/<attempt>") of the group's starts, in the order the observer saw them."""
    return [r.note for r in cluster.rows("SELECT note FROM observed WHERE kind = 'start' AND key = :g ORDER BY at",
                                         g=group)]


def started_after(cluster: Cluster, group: str, note: str, event: str) -> bool:
    """Whether the observer saw ``note`` of ``group`` start after the operator's ``event`` committed."""
    return bool(cluster.scalar(
        "SELECT min(o.at) > (SELECT max(e.at) FROM keyed_events e WHERE e.kind = :event AND e.key = :g)"
        "  FROM observed o WHERE o.kind = 'start' AND o.key = :g AND o.note = :note",
        g=group, note=note, event=event,
    ))


def wait_held(cluster: Cluster, group: str, task_id: str) -> None:
    cluster.wait_for("SELECT held_task_id FROM keyed_groups WHERE group_key = :g", task_id, timeout=WAIT, g=group)


@pytest.mark.parametrize("cluster", [LIMITS], indirect=True)
def test_halt_skip_and_hold_with_real_workers(cluster: Cluster, producer: Any) -> None:
    cluster.start_worker("w1")
    cluster.start_worker("w2")
    step = producer.step
    halt = [step.delay("halt:1", 0, fail="retry"), step.delay("halt:1", 1), step.delay("halt:1", 2)]
    skip = [step.delay("skip:1", 0, fail="retry"), step.delay("skip:1", 1), step.delay("skip:1", 2)]
    held_final = [step.delay("hold:1", 0, fail="final"), step.delay("hold:1", 1), step.delay("hold:1", 2)]
    held_retry = [step.delay("hold:2", 0, fail="retry"), step.delay("hold:2", 1)]
    skipped = [step.delay("hold:3", 0, fail="retry"), step.delay("hold:3", 1)]

    # halt (the default): the group waits through its head's retry, then goes on in order
    assert [r.get(timeout=WAIT) for r in halt] == [0, 1, 2]
    assert starts(cluster, "halt:1") == ["0/0", "0/1", "1/0", "2/0"]

    # skip: the head that asks for a retry is dead-lettered at once; its retry never runs
    assert [r.get(timeout=WAIT) for r in skip[1:]] == [1, 2]
    with pytest.raises(KeyedDeadLettered):
        skip[0].get(timeout=WAIT)
    assert starts(cluster, "skip:1") == ["0/0", "1/0", "2/0"]

    # hold, a final failure: nothing of the group starts until the operator resumes it
    wait_held(cluster, "hold:1", held_final[0].id)
    status = operator(producer.app, "status")
    assert {g["group_key"] for g in status["held_groups"]} >= {"hold:1"}
    assert operator(producer.app, "explain", held_final[1].id)["state"] == "held"
    assert starts(cluster, "hold:1") == ["0/0"]
    resumed = operator(producer.app, "resume-group", "hold:1", "--reason", "fixed")
    assert resumed["resumed"] and resumed["failed_head"] == held_final[0].id
    assert [r.get(timeout=WAIT) for r in held_final[1:]] == [1, 2]
    assert starts(cluster, "hold:1") == ["0/0", "1/0", "2/0"]
    assert started_after(cluster, "hold:1", "1/0", "group_resumed")

    # hold, a retry: the retry arrives and parks behind the hold; resumed, the failed head runs again first
    wait_held(cluster, "hold:2", held_retry[0].id)
    cluster.wait_for("SELECT count(*) FROM keyed_waiting WHERE task_id = :id AND attempt = 1", 1, timeout=WAIT,
                     id=held_retry[0].id)
    assert starts(cluster, "hold:2") == ["0/0"]
    operator(producer.app, "resume-group", "hold:2")
    assert [r.get(timeout=WAIT) for r in held_retry] == [0, 1]
    assert starts(cluster, "hold:2") == ["0/0", "0/1", "1/0"]
    assert started_after(cluster, "hold:2", "0/1", "group_resumed")

    # hold, then the operator skips the failed head: it is dead-lettered (its parked retry with it), the next runs
    wait_held(cluster, "hold:3", skipped[0].id)
    cluster.wait_for("SELECT count(*) FROM keyed_waiting WHERE task_id = :id AND attempt = 1", 1, timeout=WAIT,
                     id=skipped[0].id)
    skip_out = operator(producer.app, "skip-group-head", "hold:3", "--reason", "poison message")
    assert skip_out["dead_lettered"] is True
    assert skipped[1].get(timeout=WAIT) == 1
    with pytest.raises(KeyedDeadLettered):
        skipped[0].get(timeout=WAIT)
    assert starts(cluster, "hold:3") == ["0/0", "1/0"]
    assert started_after(cluster, "hold:3", "1/0", "group_head_skipped")

    # one member of a group at a time, under every policy
    for group in ("halt:1", "skip:1", "hold:1", "hold:2", "hold:3"):
        assert peak_overlap(cluster.intervals(group)) == 1, group
    # the books balance: every member has exactly one outcome, nothing is left open, held or waiting
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL", 0, timeout=WAIT)
    outcomes = dict(cluster.rows("SELECT outcome, count(*) FROM keyed_tasks GROUP BY outcome"))
    assert outcomes == {"completed": 10, "dead_lettered": 3}
    assert cluster.scalar("SELECT count(*) FROM keyed_group_members") == 0
    assert cluster.scalar("SELECT count(*) FROM keyed_groups WHERE held_since IS NOT NULL") == 0
    assert cluster.scalar("SELECT count(*) FROM keyed_waiting") == 0
