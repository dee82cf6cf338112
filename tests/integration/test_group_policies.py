"""Group failure policies on real Postgres (docs/groups.md): what a group does when its head fails — ``halt`` (wait
through the head's retries, move on after its final failure), ``skip`` (dead-letter the head at its first failure,
move on at once), ``hold`` (nothing of the group starts until an operator resumes it or skips its head) — for each
attempt outcome: a final failure, an explicit dead-letter and a retry count as "the head failed"; a lost worker
whose message comes back, a revoke and an expiry do not. Every test ends with the books balanced: each member has
exactly one outcome."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import sqlalchemy as sa

from celery_keyed.ledger import (
    Arrival,
    InvalidConfig,
    Ledger,
    NameConfig,
    Outcome,
    Promotion,
    Token,
    Verdict,
    WrongState,
    groups,
    groups_register,
    held_groups,
    parse_limits,
    status_names,
)

POLICIES = ("halt", "skip", "hold")


def configure(ledger: Ledger, policy: str, **acct: int) -> None:
    limits = {"order": NameConfig("order", group_failure=policy)}  # type: ignore[arg-type]
    if acct:
        limits["acct"] = NameConfig("acct", limit=acct["limit"])
    ledger.configure(limits)


def start(ledger: Ledger, *task_ids: str, group: str = "order:1", key: str | None = None, now=None) -> int:
    """Register ``task_ids`` in ``group`` in this order and let them arrive; the first is admitted: its fence."""
    for task_id in task_ids:
        ledger.transaction(lambda c, t=task_id: groups_register(c, group, t, now=now))
    fence = None
    for seq, task_id in enumerate(task_ids, start=1):
        admission = ledger.admit(Arrival(task_id, key=key, group_key=group, group_seq=seq), now=now)
        if seq == 1:
            assert admission.admitted
            fence = admission.fence
        else:
            assert admission.verdict is Verdict.PARKED
    assert fence is not None
    return fence


def ids(promotions: list[Promotion]) -> list[str]:
    return [p.task_id for p in promotions]


def complete(ledger: Ledger, promotion: Promotion, now=None) -> list[Promotion]:
    fence = ledger.bind(promotion.token, promotion.nonce, now=now)
    assert fence is not None
    return ledger.release(promotion.token, fence, Outcome.COMPLETED, now=now).promotions


def held(ledger: Ledger, group: str = "order:1") -> str | None:
    """The task whose failure holds ``group``, or None."""
    hold = ledger.group_hold(group)
    return None if hold is None else hold.task_id


# -- configuration ----------------------------------------------------------------------------------------------------


def test_the_policy_is_configured_per_name_validated_and_stored(ledger: Ledger, scalar) -> None:
    with pytest.raises(InvalidConfig, match="order: group_failure must be 'halt', 'skip' or 'hold', got 'stop'"):
        NameConfig("order", group_failure="stop")  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="group_failure must be"):
        parse_limits({"order": {"group_failure": "Skip"}})
    assert parse_limits({"order": {"group_failure": "hold"}})["order"].group_failure == "hold"
    assert NameConfig("order").group_failure == "halt"  # the default: as before
    configure(ledger, "hold")
    assert scalar("SELECT keyed_group_failure('order:7')") == "hold"
    assert scalar("SELECT keyed_group_failure('other:7')") == "halt"  # a name with no row
    with ledger.engine.connect() as conn:
        (order,) = status_names(conn, name="order")
    assert order.group_failure == "hold"
    with pytest.raises(sa.exc.IntegrityError, match="keyed_names_group_failure_known"):
        scalar("UPDATE keyed_names SET group_failure = 'pause' WHERE name = 'order' RETURNING 1")


# -- a final failure: halt and skip move on at once, hold waits for an operator ---------------------------------------


@pytest.mark.parametrize("policy", ["halt", "skip"])
@pytest.mark.parametrize("failure", [Outcome.FAILED, Outcome.DEAD_LETTERED])
def test_a_final_failure_is_dead_lettered_and_the_group_moves_on(ledger: Ledger, policy: str, failure) -> None:
    configure(ledger, policy)
    fence = start(ledger, "h", "n")
    report = ledger.release(Token("h", 0), fence, failure)
    assert report.finished == [("h", "dead_lettered")]
    (p,) = report.promotions
    assert p.task_id == "n" and held(ledger) is None
    assert complete(ledger, p) == []
    assert ledger.books() == {"dead_lettered": 1, "completed": 1, "arrivals": 2}


@pytest.mark.parametrize("failure", [Outcome.FAILED, Outcome.DEAD_LETTERED])
def test_hold_a_final_failure_holds_the_group_until_resumed(ledger: Ledger, clock, failure) -> None:
    configure(ledger, "hold")
    fence = start(ledger, "h", "n", now=clock())
    report = ledger.release(Token("h", 0), fence, failure, detail="ValueError('bad row')", now=clock())
    assert report.finished == [("h", "dead_lettered")] and report.promotions == []
    hold = ledger.group_hold("order:1")
    assert hold is not None and hold.task_id == "h"
    assert hold.reason == "its head h (attempt 0) failed: ValueError('bad row')"
    assert ledger.sweep(now=clock.advance(60)).promotions == []  # nothing of it starts, however long
    explained = ledger.explain("n", now=clock())
    assert explained.state == "held"
    assert "group order:1: the group is held since" in explained.text and "ValueError('bad row')" in explained.text
    assert "celery keyed resume-group order:1" in explained.text
    assert "its failure holds group order:1" in ledger.explain("h", now=clock()).text
    # a later member arrives: it parks behind the hold too
    ledger.transaction(lambda c: groups_register(c, "order:1", "m"))
    assert ledger.admit(Arrival("m", group_key="order:1", group_seq=3), now=clock()).verdict is Verdict.PARKED
    action = ledger.resume_group("order:1", reason="fixed the parser", author="ops", now=clock())
    assert action is not None and action.task_id == "h" and not action.skipped
    (p,) = action.promotions
    assert p.task_id == "n" and held(ledger) is None
    assert ids(complete(ledger, p, now=clock())) == ["m"]
    assert ledger.resume_group("order:1") is None  # not held: nothing changes
    assert ledger.books() == {"dead_lettered": 1, "completed": 1, "open": 1, "arrivals": 3}


def test_hold_skip_after_a_final_failure_ends_the_hold(ledger: Ledger, scalar) -> None:
    configure(ledger, "hold")
    fence = start(ledger, "h", "n")
    ledger.release(Token("h", 0), fence, Outcome.FAILED)
    action = ledger.skip_group_head("order:1", reason="bad event", author="ops")
    assert action is not None and action.task_id == "h"
    assert action.skipped is False  # it was dead-lettered at its failure: nothing more to skip
    assert ids(action.promotions) == ["n"]
    assert ledger.skip_group_head("order:1") is None
    assert complete(ledger, action.promotions[0]) == []
    assert ledger.books() == {"dead_lettered": 1, "completed": 1, "arrivals": 2}
    kinds = scalar("SELECT string_agg(kind || ':' || detail, ' | ' ORDER BY id) FROM keyed_events"
                   " WHERE key = 'order:1'")
    assert kinds.startswith("group_held:its head h (attempt 0) failed")
    assert kinds.endswith("group_head_skipped:by ops: bad event (its head had ended already)")


# -- a retry: halt waits through it, skip dead-letters the head at once, hold waits for an operator -------------------


def test_halt_a_retry_keeps_the_group_waiting_until_the_retry_runs(ledger: Ledger, clock) -> None:
    configure(ledger, "halt")
    fence = start(ledger, "h", "n", now=clock())
    assert ledger.release(Token("h", 0), fence, Outcome.RETRY, now=clock()).promotions == []
    assert held(ledger) is None
    retry = Arrival("h", attempt=1, group_key="order:1", not_before=clock() + timedelta(seconds=2))
    assert ledger.admit(retry, now=clock()).verdict is Verdict.PARKED
    (p,) = ledger.sweep(now=clock.advance(3)).promotions
    assert p.token == Token("h", 1)
    assert ids(complete(ledger, p, now=clock())) == ["n"]
    assert ledger.books() == {"completed": 1, "open": 1, "arrivals": 2}


def test_skip_a_retry_dead_letters_the_head_and_moves_on_at_once(ledger: Ledger) -> None:
    configure(ledger, "skip")
    fence = start(ledger, "h", "n")
    report = ledger.release(Token("h", 0), fence, Outcome.RETRY, detail="Retry in 30s: timeout")
    assert report.finished == [("h", "dead_lettered")]
    (p,) = report.promotions
    assert p.task_id == "n"
    assert "policy is skip" in ledger.explain("h").text
    # the retry Celery published arrives later: the task has its outcome, so it is a duplicate, dropped
    assert ledger.admit(Arrival("h", attempt=1, group_key="order:1")).verdict is Verdict.DUPLICATE
    assert complete(ledger, p) == []
    assert held(ledger) is None
    assert ledger.books() == {"dead_lettered": 1, "completed": 1, "arrivals": 2}


def test_skip_a_retry_that_arrived_first_leaves_the_waiting_room(ledger: Ledger, scalar) -> None:
    """The retry of a running head parks behind it (a countdown, or a quick redelivery); skipping the head takes it
    out of its key's line too, and the key's counters stay right."""
    configure(ledger, "skip", limit=2)
    fence = start(ledger, "h", "n", key="acct:1")
    assert ledger.admit(Arrival("h", attempt=1, key="acct:1", group_key="order:1")).verdict is Verdict.PARKED
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 2
    report = ledger.release(Token("h", 0), fence, Outcome.RETRY)
    assert report.finished == [("h", "dead_lettered")]
    (p,) = report.promotions
    assert p.task_id == "n"
    assert scalar("SELECT count(*) FROM keyed_waiting") == 0
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 0
    assert complete(ledger, p) == []
    assert ledger.sweep().drift == []
    assert ledger.books() == {"dead_lettered": 1, "completed": 1, "arrivals": 2}


def test_hold_a_retry_holds_the_group_and_resume_runs_the_retry_first(ledger: Ledger, clock) -> None:
    configure(ledger, "hold")
    fence = start(ledger, "h", "n", now=clock())
    report = ledger.release(Token("h", 0), fence, Outcome.RETRY, detail="Retry in 1s", now=clock())
    assert report.finished == [] and report.promotions == []
    hold = ledger.group_hold("order:1")
    assert hold is not None and hold.reason == "its head h (attempt 0) asked for a retry: Retry in 1s"
    assert "its failure holds group order:1" in ledger.explain("h", now=clock()).text  # between attempts
    retry = Arrival("h", attempt=1, group_key="order:1", not_before=clock() + timedelta(seconds=1))
    assert ledger.admit(retry, now=clock()).verdict is Verdict.PARKED
    assert ledger.sweep(now=clock.advance(30)).promotions == []  # due, but its group is held
    assert ledger.explain("h", now=clock()).state == "held"
    assert ledger.explain("n", now=clock()).state == "held"
    action = ledger.resume_group("order:1", author="ops", now=clock())
    assert action is not None
    (p,) = action.promotions
    assert p.token == Token("h", 1)  # the failed head runs again first: order is kept
    assert ids(complete(ledger, p, now=clock())) == ["n"]
    assert ledger.books() == {"completed": 1, "open": 1, "arrivals": 2}


def test_hold_a_retry_that_arrived_before_the_release_waits_for_the_operator(ledger: Ledger, scalar) -> None:
    configure(ledger, "hold")
    fence = start(ledger, "h", "n")
    assert ledger.admit(Arrival("h", attempt=1, group_key="order:1")).verdict is Verdict.PARKED  # behind itself
    assert ledger.release(Token("h", 0), fence, Outcome.RETRY).promotions == []
    assert held(ledger) == "h"
    assert scalar("SELECT bool_and(group_blocked) FROM keyed_waiting") is True  # out of every ready index
    assert ledger.sweep().promotions == []
    # the policy changed meanwhile: a hold already set stays until an operator ends it
    configure(ledger, "halt")
    assert ledger.sweep().promotions == [] and held(ledger) == "h"
    action = ledger.resume_group("order:1")
    assert action is not None
    (p,) = action.promotions
    assert p.token == Token("h", 1)
    assert ids(complete(ledger, p)) == ["n"]


def test_hold_skip_while_the_retry_is_in_transit_drops_it_when_it_arrives(ledger: Ledger) -> None:
    configure(ledger, "hold")
    fence = start(ledger, "h", "n")
    ledger.release(Token("h", 0), fence, Outcome.RETRY)
    action = ledger.skip_group_head("order:1", reason="poison message")
    assert action is not None and action.skipped and ids(action.promotions) == ["n"]
    assert ledger.explain("h").text.startswith("finished: dead_lettered (head of a held group skipped")
    assert ledger.admit(Arrival("h", attempt=1, group_key="order:1")).verdict is Verdict.DUPLICATE
    assert complete(ledger, action.promotions[0]) == []
    assert ledger.books() == {"dead_lettered": 1, "completed": 1, "arrivals": 2}


def test_hold_skip_takes_the_parked_retry_out_of_its_keys_line(ledger: Ledger, scalar) -> None:
    configure(ledger, "hold", limit=1)
    fence = start(ledger, "h", "n", key="acct:1")
    ledger.release(Token("h", 0), fence, Outcome.RETRY)
    assert ledger.admit(Arrival("h", attempt=1, key="acct:1", group_key="order:1")).verdict is Verdict.PARKED
    # another task of the key is not blocked by the held group's members in the key's line
    other = ledger.admit(Arrival("o", key="acct:1"))
    assert other.admitted
    action = ledger.skip_group_head("order:1")
    assert action is not None and action.skipped
    assert action.promotions == []  # n is the head now, but acct:1 is full
    (p,) = ledger.release(Token("o", 0), other.fence, Outcome.COMPLETED).promotions
    assert p.task_id == "n"
    assert complete(ledger, p) == []
    assert scalar("SELECT waiting FROM keyed_keys WHERE key = 'acct:1'") == 0
    assert ledger.sweep().drift == []
    assert ledger.books() == {"dead_lettered": 1, "completed": 2, "arrivals": 3}


# -- outcomes that are not a failure of the head: the same under every policy -----------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_lost_worker_whose_message_comes_back_is_not_a_failure(ledger: Ledger, policy: str) -> None:
    configure(ledger, policy)
    fence = start(ledger, "h", "n")
    assert ledger.release(Token("h", 0), fence, Outcome.WORKER_LOST).finished == []
    assert held(ledger) is None
    again = ledger.admit(Arrival("h", group_key="order:1", group_seq=1))  # the broker's redelivery
    assert again.admitted
    (p,) = ledger.release(Token("h", 0), again.fence, Outcome.COMPLETED).promotions
    assert p.task_id == "n"
    assert complete(ledger, p) == []
    assert ledger.books() == {"completed": 2, "arrivals": 2}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_revoked_head_is_not_a_failure(ledger: Ledger, policy: str) -> None:
    configure(ledger, policy)
    fence = start(ledger, "h", "n")
    report = ledger.release(Token("h", 0), fence, Outcome.REVOKED)
    assert report.finished == [("h", "revoked")]
    (p,) = report.promotions
    assert p.task_id == "n" and held(ledger) is None
    assert complete(ledger, p) == []
    assert ledger.books() == {"revoked": 1, "completed": 1, "arrivals": 2}


@pytest.mark.parametrize("policy", POLICIES)
def test_an_expired_head_is_not_a_failure(ledger: Ledger, clock, policy: str) -> None:
    """A head that waits for its key past its latest start expires; its group moves on under every policy."""
    configure(ledger, policy, limit=1)
    other = ledger.admit(Arrival("o", key="acct:1"), now=clock())
    deadline = clock() + timedelta(seconds=5)
    head = Arrival("h", key="acct:1", group_key="order:1", deadline=deadline)
    assert ledger.admit(head, now=clock()).verdict is Verdict.PARKED
    assert ledger.admit(Arrival("n", key="acct:1", group_key="order:1"), now=clock()).verdict is Verdict.PARKED
    report = ledger.sweep(now=clock.advance(10))
    assert ("h", "expired") in report.finished
    assert held(ledger) is None
    (p,) = ledger.release(Token("o", 0), other.fence, Outcome.COMPLETED, now=clock()).promotions
    assert p.task_id == "n"
    assert complete(ledger, p, now=clock()) == []
    assert ledger.books() == {"expired": 1, "completed": 2, "arrivals": 3}


# -- a held group meets the other outcomes: the hold stays until an operator acts -------------------------------------


def test_a_held_groups_parked_retry_may_expire_or_be_revoked_the_hold_stays(ledger: Ledger, clock) -> None:
    configure(ledger, "hold")
    fence = start(ledger, "h", "n", now=clock())
    ledger.release(Token("h", 0), fence, Outcome.RETRY, now=clock())
    retry = Arrival("h", attempt=1, group_key="order:1", deadline=clock() + timedelta(seconds=5))
    assert ledger.admit(retry, now=clock()).verdict is Verdict.PARKED
    report = ledger.sweep(now=clock.advance(10))
    assert ("h", "expired") in report.finished and report.promotions == []
    assert held(ledger) == "h"  # the operator still decides
    ledger.revoke("n", now=clock())  # a revoke of a member of a held group
    assert ledger.explain("n", now=clock()).text.startswith("finished: revoked")
    assert held(ledger) == "h"
    action = ledger.resume_group("order:1", now=clock())
    assert action is not None and action.promotions == []  # nothing left to run
    assert ledger.books() == {"expired": 1, "revoked": 1, "arrivals": 2}


def test_a_skip_that_races_a_resume_changes_nothing(ledger: Ledger, engine: sa.Engine, scalar) -> None:
    """The skip is guarded by the hold it saw: when another operator resumes the group while the skip waits for the
    group's lock, the skip raises and rolls back whole (the head is not dead-lettered)."""
    configure(ledger, "hold")
    fence = start(ledger, "h", "n")
    ledger.release(Token("h", 0), fence, Outcome.RETRY)
    failures: list[BaseException] = []
    with engine.connect() as resumer:
        resumer.begin()
        assert resumer.execute(groups.GROUPS_RESUME, {"group_key": "order:1", "task_id": None}).first() is not None

        def skip() -> None:
            try:
                ledger.skip_group_head("order:1")
            except BaseException as exc:
                failures.append(exc)

        skipper = threading.Thread(target=skip)
        skipper.start()
        deadline = time.monotonic() + 60
        while scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'") == 0:
            assert time.monotonic() < deadline, "the skip never waited for the group's lock"
            time.sleep(0.01)
        resumer.commit()
    skipper.join(60)
    assert not skipper.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], WrongState)
    assert "resumed or skipped meanwhile" in str(failures[0])
    assert held(ledger) is None
    assert ledger.explain("h").state == "between_attempts"  # not dead-lettered: the resume won
    assert scalar("SELECT count(*) FROM keyed_events WHERE kind = 'group_head_skipped'") == 0


def test_status_lists_the_held_groups_oldest_first(ledger: Ledger) -> None:
    configure(ledger, "hold")
    for group in ("order:2", "order:1"):
        fence = start(ledger, f"h{group}", f"n{group}", group=group)
        ledger.release(Token(f"h{group}", 0), fence, Outcome.FAILED)
    with ledger.engine.connect() as conn:
        groups = held_groups(conn)
    assert [(g.group_key, g.task_id, g.members) for g in groups] == [("order:2", "horder:2", 1),
                                                                    ("order:1", "horder:1", 1)]


def test_a_failed_head_settled_after_its_release_was_lost_holds_its_group(ledger: Ledger) -> None:
    configure(ledger, "hold")
    fence = start(ledger, "h", "n")
    ledger.release(Token("h", 0), fence, Outcome.WORKER_LOST)  # its release lost; its FAILURE result stored
    settled, promotions = ledger.settle("h", "failed", detail="booked from its FAILURE result")
    assert settled and promotions == []
    assert held(ledger) == "h"
    action = ledger.skip_group_head("order:1")
    assert action is not None and ids(action.promotions) == ["n"]
