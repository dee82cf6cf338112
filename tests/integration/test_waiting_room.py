"""Bounded waiting rooms and the books (§3.6), fed in a known order so identities are exact."""

from __future__ import annotations

from datetime import timedelta

from celery_keyed.ledger import Arrival, Ledger, NameConfig, Outcome, Token, Verdict

UNIT = 1.0  # seconds per time unit of the fixture


def test_eight_arrivals_two_slots_three_places(ledger: Ledger, clock) -> None:
    """Two slots, three waiting places, service 4 units, expiry 6 units from arrival; eight arrivals at once:
    A, B run; C, D, E wait; F, G, H are rejected; C and D start at 4; E expires at 6; books 4+1+3 = 8."""
    t0 = clock()
    ledger.configure({"research": NameConfig("research", limit=2, max_waiting=3, max_wait=6 * UNIT)}, now=t0)
    verdicts = {}
    fences = {}
    for t in "ABCDEFGH":
        adm = ledger.admit(Arrival(t, key="research:topic", message={"id": t}), now=t0)
        verdicts[t] = adm.verdict
        fences[t] = adm.fence
    assert verdicts == {
        "A": Verdict.ADMITTED, "B": Verdict.ADMITTED,
        "C": Verdict.PARKED, "D": Verdict.PARKED, "E": Verdict.PARKED,
        "F": Verdict.REJECTED, "G": Verdict.REJECTED, "H": Verdict.REJECTED,
    }  # fmt: skip
    started = {"A": 0.0, "B": 0.0}
    t4 = t0 + timedelta(seconds=4 * UNIT)
    for t in "AB":
        for p in ledger.release(Token(t, 0), fences[t], Outcome.COMPLETED, now=t4).promotions:
            fences[p.task_id] = ledger.bind(p.token, p.nonce, now=t4)
            started[p.task_id] = 4.0
    assert started == {"A": 0.0, "B": 0.0, "C": 4.0, "D": 4.0}
    assert ledger.sweep(now=t0 + timedelta(seconds=5.9 * UNIT)).finished == []
    assert ledger.sweep(now=t0 + timedelta(seconds=6 * UNIT)).finished == [("E", "expired")]
    t8 = t0 + timedelta(seconds=8 * UNIT)
    for t in "CD":
        assert ledger.release(Token(t, 0), fences[t], Outcome.COMPLETED, now=t8).promotions == []
    assert ledger.books() == {"completed": 4, "expired": 1, "rejected": 3, "arrivals": 8}


def test_every_arrival_gets_exactly_one_outcome(ledger: Ledger, clock) -> None:
    ledger.configure({"r": NameConfig("r", limit=1, max_waiting=2, max_wait=5)}, now=clock())
    a = ledger.admit(Arrival("a", key="r:1"), now=clock())
    ledger.admit(Arrival("b", key="r:1"), now=clock())
    ledger.admit(Arrival("c", key="r:1"), now=clock())
    ledger.admit(Arrival("d", key="r:1"), now=clock())  # rejected
    ledger.revoke("c", now=clock())
    ledger.admit(Arrival("e", key="r:1", deadline=clock() - timedelta(seconds=1)), now=clock())  # expired
    (p,) = ledger.release(Token("a", 0), a.fence, Outcome.FAILED, now=clock()).promotions
    fence = ledger.bind(p.token, p.nonce, now=clock())
    ledger.release(p.token, fence, Outcome.COMPLETED, now=clock())
    # a second release of the same attempt records nothing more
    ledger.release(Token("a", 0), a.fence, Outcome.COMPLETED, now=clock())
    assert ledger.books() == {"failed": 1, "completed": 1, "rejected": 1, "revoked": 1, "expired": 1, "arrivals": 5}
