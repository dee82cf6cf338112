"""A worker restarted on the same machine gives back at once the claims of a predecessor whose processes are
all gone (issue 9 item 8), on real Postgres: and only those — a live holder, or one of another machine (whose
pids mean nothing here), keeps its claims until its lease says otherwise."""

from __future__ import annotations

import os
import subprocess

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, Verdict, new_holder
from celery_keyed.ledger.holders import holders_register, machine_identity, pid_gone


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert pid_gone(proc.pid)
    return proc.pid


def _holders(engine: sa.Engine, task_id: str) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(sa.text("SELECT holder FROM keyed_claims WHERE task_id = :t"), {"t": task_id}).scalars()
        )


def test_claims_of_a_dead_predecessor_on_this_machine_come_back_at_once(engine: sa.Engine) -> None:
    assert machine_identity() is not None
    dead = Ledger(engine, holder=new_holder("w1@host", pid=_dead_pid()), lease=600)
    dead.register_holder(pids=[_dead_pid(), _dead_pid()])
    alive = Ledger(engine, holder=new_holder("w2@host"), lease=600)
    alive.register_holder(pids=[os.getpid()])
    elsewhere = Ledger(engine, holder=new_holder("w3@other", pid=_dead_pid()), lease=600)
    with engine.begin() as conn:
        holders_register(conn, elsewhere.holder, machine="another-boot/1", pids=[_dead_pid()])

    assert dead.admit(Arrival("d1", key="acct:1", message={})).verdict is Verdict.ADMITTED
    assert alive.admit(Arrival("a1", key="acct:2", message={})).verdict is Verdict.ADMITTED
    assert elsewhere.admit(Arrival("e1", key="acct:3", message={})).verdict is Verdict.ADMITTED
    behind = alive.admit(Arrival("d2", key="acct:1", task_name="t", queue="celery", message={"task": "t"}))
    assert behind.verdict is Verdict.PARKED

    successor = Ledger(engine, holder=new_holder("w1@host"), lease=600)
    successor.register_holder(pids=[os.getpid()])
    report = successor.reclaim_gone_predecessors()

    assert [t.task_id for t in report.reclaimed] == ["d1"]
    assert [p.task_id for p in report.promotions] == ["d2"]  # the line moves on without waiting for the lease
    assert _holders(engine, "d1") == [] and _holders(engine, "a1") == [alive.holder]
    assert _holders(engine, "e1") == [elsewhere.holder]
    with engine.connect() as conn:
        outcome = conn.execute(sa.text("SELECT outcome FROM keyed_tasks WHERE task_id = 'd1'")).scalar()
    assert outcome is None  # worker lost, not finished: a redelivery of d1 is admitted again
    assert successor.reclaim_gone_predecessors().reclaimed == []  # idempotent


def test_a_holder_with_a_pool_process_still_alive_keeps_its_claims(engine: sa.Engine) -> None:
    """The main process was SIGKILLed but a pool process still runs its body: not gone."""
    orphaned = Ledger(engine, holder=new_holder("w1@host", pid=_dead_pid()), lease=600)
    orphaned.register_holder(pids=[_dead_pid(), os.getpid()])
    assert orphaned.admit(Arrival("o1", key="acct:9", message={})).verdict is Verdict.ADMITTED
    successor = Ledger(engine, holder=new_holder("w1@host"), lease=600)
    successor.register_holder(pids=[os.getpid()])
    assert successor.reclaim_gone_predecessors().reclaimed == []
    assert _holders(engine, "o1") == [orphaned.holder]
