"""Ordered groups (D10): heads, backoff, dead-letter, lost numbers, composition with a key."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict, groups_register


def register(ledger: Ledger, group: str, *task_ids: str, now=None) -> list[int]:
    return [ledger.transaction(lambda c, t=t: groups_register(c, group, t, now=now)) for t in task_ids]


def run_to_end(ledger: Ledger, promotion) -> list[str]:
    """Bind and complete a promotion and every promotion that follows from it; the order they ran in."""
    ran = []
    queue = [promotion]
    while queue:
        p = queue.pop(0)
        fence = ledger.bind(p.token, p.nonce)
        assert fence is not None
        ran.append(p.task_id)
        queue += ledger.release(p.token, fence, Outcome.COMPLETED).promotions
    return ran


def test_registered_numbers_run_in_order_whatever_the_receipt_order(ledger: Ledger) -> None:
    assert register(ledger, "order:1", "e1", "e2", "e3") == [1, 2, 3]
    assert ledger.admit(Arrival("e3", group_key="order:1", group_seq=3)).verdict is Verdict.PARKED
    assert ledger.admit(Arrival("e2", group_key="order:1", group_seq=2)).verdict is Verdict.PARKED
    head = ledger.admit(Arrival("e1", group_key="order:1", group_seq=1))
    assert head.admitted
    assert ledger.explain("e3").state == "blocked"
    (p,) = ledger.release(Token("e1", 0), head.fence, Outcome.COMPLETED).promotions
    assert run_to_end(ledger, p) == ["e2", "e3"]
    assert ledger.books() == {"completed": 3, "arrivals": 3}


def test_unregistered_members_are_ordered_by_receipt(ledger: Ledger) -> None:
    a = ledger.admit(Arrival("a", group_key="g:1"))
    assert a.admitted
    assert ledger.admit(Arrival("b", group_key="g:1")).verdict is Verdict.PARKED
    assert ledger.admit(Arrival("c", group_key="g:1")).verdict is Verdict.PARKED
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED).promotions
    assert run_to_end(ledger, p) == ["b", "c"]


def test_head_in_backoff_keeps_the_group_waiting(ledger: Ledger, clock) -> None:
    """§3.5: for a group key the failing task stays the head through its backoff."""
    register(ledger, "order:1", "h", "n")
    head = ledger.admit(Arrival("h", group_key="order:1", group_seq=1), now=clock())
    assert ledger.admit(Arrival("n", group_key="order:1", group_seq=2), now=clock()).verdict is Verdict.PARKED
    assert ledger.release(Token("h", 0), head.fence, Outcome.RETRY, now=clock()).promotions == []
    assert ledger.sweep(now=clock.advance(5)).promotions == []  # still blocked during the backoff
    assert ledger.explain("n", now=clock()).state == "blocked"
    retry = ledger.admit(
        Arrival("h", attempt=1, group_key="order:1", not_before=clock() + timedelta(seconds=2)), now=clock()
    )
    assert retry.verdict is Verdict.PARKED  # backoff countdown as not_before
    (p,) = ledger.sweep(now=clock.advance(3)).promotions
    assert p.token == Token("h", 1)
    fence = ledger.bind(p.token, p.nonce, now=clock())
    (q,) = ledger.release(p.token, fence, Outcome.COMPLETED, now=clock()).promotions
    assert q.task_id == "n"


def test_retry_that_arrives_before_the_release_waits_for_it(ledger: Ledger) -> None:
    head = ledger.admit(Arrival("h", group_key="g:1"))
    assert ledger.admit(Arrival("h", attempt=1, group_key="g:1")).verdict is Verdict.PARKED
    (p,) = ledger.release(Token("h", 0), head.fence, Outcome.RETRY).promotions
    assert p.token == Token("h", 1)


def test_final_failure_of_a_head_is_dead_lettered_and_the_group_moves_on(ledger: Ledger) -> None:
    head = ledger.admit(Arrival("h", group_key="g:1"))
    ledger.admit(Arrival("n", group_key="g:1"))
    report = ledger.release(Token("h", 0), head.fence, Outcome.FAILED)
    assert report.finished == [("h", "dead_lettered")]
    assert [p.task_id for p in report.promotions] == ["n"]
    assert ledger.explain("h").text == "finished: dead_lettered"


def test_a_number_never_received_is_recorded_lost_and_skipped(ledger: Ledger, clock) -> None:
    register(ledger, "g:1", "ghost", "next", now=clock())
    assert ledger.admit(Arrival("next", group_key="g:1", group_seq=2), now=clock()).verdict is Verdict.PARKED
    assert ledger.explain("next", now=clock()).text.endswith("has not arrived yet")
    assert ledger.sweep(now=clock.advance(10), group_arrival_timeout=300).promotions == []
    report = ledger.sweep(now=clock.advance(3600), group_arrival_timeout=300)
    assert ("ghost", "lost") in report.finished
    assert [p.task_id for p in report.promotions] == ["next"]
    assert ledger.admit(Arrival("ghost", group_key="g:1", group_seq=1)).verdict is Verdict.DUPLICATE


def test_registration_rolls_back_with_the_producers_transaction(ledger: Ledger, engine: sa.Engine) -> None:
    with engine.connect() as conn:
        conn.begin()
        groups_register(conn, "g:1", "x")
        conn.rollback()
    assert register(ledger, "g:1", "y") == [1]


def test_group_with_a_concurrency_key_needs_both(ledger: Ledger) -> None:
    """A task may carry a concurrency key and a group key together (§3.10)."""
    ledger.configure({"acct": NameConfig("acct", limit=1)})
    other = ledger.admit(Arrival("o", key="acct:1"))  # holds the account
    head = ledger.admit(Arrival("h", key="acct:1", group_key="order:1"))
    assert head.verdict is Verdict.PARKED  # head of its group, but the key is full
    nxt = ledger.admit(Arrival("n", key="acct:1", group_key="order:1"))
    assert nxt.verdict is Verdict.PARKED
    (p,) = ledger.release(Token("o", 0), other.fence, Outcome.COMPLETED).promotions
    assert p.task_id == "h"  # n is behind h in its group, even though both wait for the key
    assert run_to_end(ledger, p) == ["h", "n"]
