"""``explain(task_id)``: why an attempt is (not) running, in an operator's words."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import call_limits, windows
from celery_keyed.ledger.bounds import is_exclusive
from celery_keyed.ledger.caps import capped_name
from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.fair_weights import fair_shares
from celery_keyed.ledger.groups import groups_hold_get
from celery_keyed.ledger.key_overrides import KeyOverride, key_override_get
from celery_keyed.ledger.keyspec import key_name, validate_task_id
from celery_keyed.ledger.slots import in_flight

EXPLAIN_TASK = sa.text(
    "SELECT task_id, key, group_key, outcome, detail, finished_attempt, arrived_at FROM keyed_tasks"
    " WHERE task_id = :task_id"
)
EXPLAIN_CLAIM = sa.text(
    f"""
    SELECT attempt, key, shard, group_key, state, fence, holder, dispatch_deadline,
           EXTRACT(EPOCH FROM lease_expires_at - {NOW}) AS lease_left, cost, extra_keys, held_outcome,
           lease_expires_at, cancel_requested_at, cancel_detail, claimed_at,
           (SELECT COALESCE(sum({in_flight('s.used')}), 0) FROM keyed_slots s WHERE s.key = c.key) AS in_flight,
           CASE WHEN key IS NOT NULL THEN keyed_key_limit(key, {NOW}) END AS k
      FROM keyed_claims c WHERE task_id = :task_id ORDER BY attempt DESC LIMIT 1
    """
)
EXPLAIN_WAITING = sa.text(
    f"""
    SELECT w.attempt, w.key, w.keys, w.cost, w.group_key, w.group_seq, w.shadow, w.group_blocked, w.deadline,
           w.priority, w.debounce_key, w.debounce_cap, w.fair_key, w.arrived_at,
           COALESCE((SELECT c.fair FROM keyed_names c WHERE c.name = split_part(w.key, ':', 1)), false) AS fair,
           w.not_before, w.not_before > {NOW} AS not_due,
           (SELECT count(*) FROM keyed_waiting o
             WHERE o.key = w.key AND NOT o.shadow AND o.not_before IS NULL AND NOT o.group_blocked
               AND (o.priority > w.priority OR (o.priority = w.priority AND o.arrival < w.arrival))) AS ahead,
           (SELECT COALESCE(sum({in_flight('s.used')}), 0) FROM keyed_slots s WHERE s.key = w.key) AS in_flight,
           keyed_key_limit(w.key, {NOW}) AS k
      FROM keyed_waiting w WHERE w.task_id = :task_id ORDER BY w.attempt DESC LIMIT 1
    """
)
EXPLAIN_GROUP = sa.text(
    """
    SELECT m.seq, m.task_id, m.received,
           (SELECT c.task_id FROM keyed_claims c WHERE c.group_key = :group_key) AS running
      FROM keyed_group_members m WHERE m.group_key = :group_key ORDER BY m.seq LIMIT 1
    """
)
# explain_sent: a send accepted at send (keyed_sent), and whether it still holds its place (not past expires_at).
EXPLAIN_SENT = sa.text(
    f"SELECT key, dedupe_key, sent_at, expires_at, expires_at > {NOW} AS holding FROM keyed_sent"
    " WHERE task_id = :task_id"
)
# explain_outbox: a task registered at publish (keyed_outbox) and not received yet.
EXPLAIN_OUTBOX = sa.text(
    f"SELECT registered_at, due_at, pending, republished, republished_at, due_at <= {NOW} AS due FROM keyed_outbox"
    " WHERE task_id = :task_id"
)
# explain_retry: a task between attempts whose retry was registered at its publish (migration 0023).
EXPLAIN_RETRY = sa.text(
    "SELECT attempt, registered_at, due_at, republished, message IS NOT NULL AS has_copy,"
    f" due_at <= {NOW} AS overdue FROM keyed_outbox WHERE task_id = :task_id AND attempt > 0"
)
EXPLAIN_MEMBER = sa.text("SELECT group_key, seq, received FROM keyed_group_members WHERE task_id = :task_id")


@dataclass
class Explanation:
    """``state`` is one of unknown, outbox, registered, sent, running, promoted, waiting, paused, blocked, not_before,
    debounced (a debounced task waiting out its key's quiet period), held (a member of a group held for an operator),
    shadow, between_attempts, finished; ``text`` says it in a sentence; ``facts`` has the numbers."""

    task_id: str
    state: str
    text: str
    facts: dict[str, Any] = field(default_factory=dict)


def explain(conn: sa.Connection, task_id: str, *, now: datetime | None = None) -> Explanation:
    """Where ``task_id`` is and why, in the order a task moves: not received yet (``_explain_not_received``), an
    uncertain hold, finished, holding a claim (``_explain_claim``), between attempts (``_explain_between_attempts``),
    or waiting (``_explain_waiting``)."""
    validate_task_id(task_id)  # a wrong type or text PostgreSQL cannot hold: InvalidKey, not a driver error
    task = conn.execute(EXPLAIN_TASK, {"task_id": task_id}).mappings().first()
    member = conn.execute(EXPLAIN_MEMBER, {"task_id": task_id}).mappings().first()
    if task is None:
        return _explain_not_received(conn, task_id, member, now=now)
    claim = conn.execute(EXPLAIN_CLAIM, {"task_id": task_id, "now": now}).mappings().first()
    if claim is not None and claim["state"] == "uncertain":
        return Explanation(
            task_id,
            "uncertain",
            f"attempt {claim['attempt']} is over ({claim['held_outcome']}) but its remote call may still be running:"
            f" its slots of {_holds(claim)} stay held for {max(float(claim['lease_left']), 0.0):.1f}s more"
            " (uncertain hold)",
            {**claim, "mode": _mode(claim)},
        )
    if task["outcome"] is not None:
        facts = dict(task)
        return Explanation(
            task_id,
            "finished",
            f"finished: {task['outcome']}" + (f" ({task['detail']})" if task["detail"] else "")
            + _held_by_me(conn, task_id, task["group_key"], facts),
            facts,
        )
    if claim is not None:
        return _explain_claim(task_id, claim)
    wait = conn.execute(EXPLAIN_WAITING, {"task_id": task_id, "now": now}).mappings().first()
    if wait is None:
        between = _explain_between_attempts(conn, task_id, task, now=now)
        between.text += _held_by_me(conn, task_id, task["group_key"], between.facts)
        return between
    return _explain_waiting(conn, task_id, wait, now=now)


def _held_by_me(conn: sa.Connection, task_id: str, group_key: str | None, facts: dict[str, Any]) -> str:
    """When ``task_id``'s failure holds its group for an operator: a clause saying so (and ``facts["group_hold"]``)."""
    if group_key is None:
        return ""
    hold = groups_hold_get(conn, group_key)
    if hold is None or hold.held_task_id != task_id:
        return ""
    facts["group_hold"] = dict(hold._mapping)
    since = f"{hold.held_since:%Y-%m-%d %H:%M:%S%z}"
    return f"; its failure holds group {group_key} since {since} ({_operator_actions(group_key)})"


def _operator_actions(group_key: str) -> str:
    return (f"nothing of the group starts until an operator resumes it (celery keyed resume-group {group_key}) or"
            f" skips its failed head (celery keyed skip-group-head {group_key})")


def _explain_not_received(conn: sa.Connection, task_id: str, member: Any, *, now: datetime | None) -> Explanation:
    """A task id the books do not hold: in the outbox, registered in a group, accepted at send, or unknown."""
    outbox = conn.execute(EXPLAIN_OUTBOX, {"task_id": task_id, "now": now}).mappings().first()
    if outbox is not None:
        group = f" (number {member['seq']} of group {member['group_key']})" if member is not None else ""
        if outbox["pending"]:
            then = "not published yet: the relay publishes it once the transaction that registered it commits"
        else:
            times = outbox["republished"]
            then = (
                f"republished {times} time{'' if times == 1 else 's'}; "
                + ("due to be published again now" if outbox["due"] else f"published again at {outbox['due_at']}")
                + " if still not received"
            )
        return Explanation(
            task_id,
            "outbox",
            f"registered at publish at {outbox['registered_at']}{group}, not received by a worker yet, {then}",
            dict(outbox),
        )
    if member is not None:
        return Explanation(
            task_id,
            "registered",
            f"registered as number {member['seq']} of group {member['group_key']}, not received by a worker yet",
            dict(member),
        )
    sent = conn.execute(EXPLAIN_SENT, {"task_id": task_id, "now": now}).mappings().first()
    if sent is not None:
        dedupe = f" (dedupe key {sent['dedupe_key']})" if sent["dedupe_key"] else ""
        hold = (
            f"it holds a place in the waiting room of {sent['key']}{dedupe} until {sent['expires_at']}"
            if sent["holding"]
            else f"its place in the waiting room of {sent['key']} lapsed at {sent['expires_at']} (lost in transit?)"
        )
        return Explanation(
            task_id,
            "sent",
            f"accepted at send at {sent['sent_at']}, not received by a worker yet: {hold}",
            dict(sent),
        )
    return Explanation(
        task_id,
        "unknown",
        "the ledger has no record of this task id (not keyed, not received yet, or finished longer ago than"
        " keyed_books_retention)",
    )


def _explain_claim(task_id: str, claim: Any) -> Explanation:
    """An attempt that holds a claim: promoted (being dispatched) or running."""
    holds = _holds(claim)
    # Newest wins: a newer arrival asked this attempt to stop; its worker ends it and records it superseded.
    cancel = (
        f"; cancel requested at {claim['cancel_requested_at']:%Y-%m-%d %H:%M:%S%z}: {claim['cancel_detail']}"
        if claim["cancel_requested_at"] is not None
        else ""
    )
    if claim["state"] == "promoted":
        return Explanation(
            task_id,
            "promoted",
            f"attempt {claim['attempt']} was given a slot of {holds} and "
            f"is being dispatched (deadline {claim['dispatch_deadline']}){cancel}",
            {**claim, "mode": _mode(claim)},
        )
    return Explanation(
        task_id,
        "running",
        f"attempt {claim['attempt']} is running under {holds}, fence "
        f"{claim['fence']}, holder {claim['holder']}, lease left "
        f"{float(claim['lease_left']):.1f}s{cancel}",
        {**claim, "mode": _mode(claim)},
    )


def _explain_between_attempts(conn: sa.Connection, task_id: str, task: Any, *, now: datetime | None) -> Explanation:
    """An open task with no attempt running or waiting: between attempts, with its registered retry if any."""
    retry = conn.execute(EXPLAIN_RETRY, {"task_id": task_id, "now": now}).mappings().first()
    text = "no attempt is running or waiting: between attempts (retry backoff or in transit)"
    facts = dict(task)
    if retry is not None:
        facts["retry"] = dict(retry)
        if not (retry["overdue"] or retry["republished"]):
            then = f"expected by {retry['due_at']}"
        elif retry["has_copy"]:
            then = f"not received in time: published again from the outbox {retry['republished']} times"
        else:
            then = "not received in time, no copy to publish again (reported by reconcile)"
        text += f"; retry {retry['attempt']} published at {retry['registered_at']}, {then}"
    return Explanation(task_id, "between_attempts", text, facts)


def _full_windows(conn: sa.Connection, wait: Any, facts: dict[str, Any], *, now: datetime | None) -> str:
    """What the attempt's rate windows say (into ``facts["rate_windows"]`` by key), as a clause naming the full ones:
    a window refused its start, and the not-before time is when the window frees."""
    said = []
    for key in wait["keys"] or ([wait["key"]] if wait["key"] is not None else []):
        uses = windows.usage(conn, key, key_name(key), now=now)
        if uses:
            facts.setdefault("rate_windows", {})[key] = [dataclasses.asdict(u) for u in uses]
        said += [
            f"rate window {windows.window_text(u.n, u.seconds)} of key {key} is full ({u.used} starts in it; the next"
            f" may start at {u.frees_at})"
            for u in uses
            if u.full
        ]
    return f": {'; '.join(said)}" if said else ""


def _explain_waiting(conn: sa.Connection, task_id: str, wait: Any, *, now: datetime | None) -> Explanation:
    """A waiting attempt: a shadow, debounced, not due yet, blocked by its group, or waiting for slots."""
    facts = {**wait, "mode": _mode(wait)}
    own = key_override_get(conn, wait["key"], now=now) if wait["key"] is not None else None
    if own is not None:  # a key override: the key's own limit, its pause
        facts["key_override"] = own.as_dict()
    called = call_limits.get(conn, wait["key"], now=now) if wait["key"] is not None else None
    if called is not None:  # the limit the key's latest call computed
        facts["call_limit"] = called.as_dict()
    if wait["shadow"]:
        return Explanation(
            task_id,
            "shadow",
            "a duplicate delivery kept as the shadow of its running attempt "
            "(it runs only if that attempt's worker is lost)",
            facts,
        )
    if wait["not_due"] and wait["debounce_cap"] is not None:  # debounce
        return Explanation(
            task_id,
            "debounced",
            f"debounced until {wait['not_before']} (later arrivals of key {wait['key']} replace it or move that "
            f"time, until {wait['debounce_cap']} at the latest); then it waits for a slot like any other",
            facts,
        )
    if wait["not_due"]:
        text = f"not before {wait['not_before']}" + _full_windows(conn, wait, facts, now=now)
        return Explanation(task_id, "not_before", text, facts)
    if wait["group_key"] is not None and (hold := groups_hold_get(conn, wait["group_key"])) is not None:
        facts["group_hold"] = dict(hold._mapping)
        return Explanation(
            task_id,
            "held",
            f"number {wait['group_seq']} of group {wait['group_key']}: the group is held since"
            f" {hold.held_since:%Y-%m-%d %H:%M:%S%z}"
            f" because {hold.held_reason}; {_operator_actions(wait['group_key'])}",
            facts,
        )
    blocked = _blocked_by_group(conn, task_id, wait, facts) if wait["group_key"] is not None else None
    if blocked is not None:
        return blocked
    return _waiting_for_slots(conn, task_id, wait, own, facts, called=called, now=now)


def _blocked_by_group(conn: sa.Connection, task_id: str, wait: Any, facts: dict[str, Any]) -> Explanation | None:
    """A group member behind its group's head (running, not arrived or not finished); None: not blocked."""
    head = conn.execute(EXPLAIN_GROUP, {"group_key": wait["group_key"]}).mappings().first()
    if head is None or (head["seq"] == wait["group_seq"] and head["running"] is None):
        return None
    blocker = head["running"] or head["task_id"]
    facts["blocked_by"] = blocker
    why = "is running" if head["running"] else ("has not arrived yet" if not head["received"] else "has not finished")
    return Explanation(
        task_id,
        "blocked",
        f"number {wait['group_seq']} of group {wait['group_key']}: the group head, task {blocker}, {why}",
        facts,
    )


def _waiting_for_slots(
    conn: sa.Connection,
    task_id: str,
    wait: Any,
    own: Any,
    facts: dict[str, Any],
    *,
    called: call_limits.CallLimit | None = None,
    now: datetime | None,
) -> Explanation:
    """A waiter for slots: of several keys at once, of a paused key, of a fair name, of one key; or for its group."""
    capped = capped_name(wait["key"]) if wait["key"] is not None else None
    if wait["keys"] and capped is not None:  # in the line of its name's cap
        return Explanation(
            task_id,
            "waiting",
            f"waiting for the cap of {capped}: its keys hold {wait['in_flight']} of {wait['k']} together;"
            f" {wait['ahead']} waiting ahead (its own keys, {', '.join(k for k in wait['keys'] if k != wait['key'])},"
            " have room)",
            facts,
        )
    if wait["keys"]:
        return Explanation(
            task_id,
            "waiting",
            f"needs a slot of every one of {', '.join(wait['keys'])} at once"
            + (f" ({wait['cost']} slots each)" if wait["cost"] > 1 else "")
            + f"; {wait['ahead']} waiting ahead for {wait['key']} (in flight {wait['in_flight']}/{wait['k']})",
            facts,
        )
    if wait["key"] is not None:
        if wait["k"] == 0:
            return Explanation(task_id, "paused", _paused_text(wait, own, called), facts)
        if wait["fair"]:
            return Explanation(task_id, "waiting", _fair_text(conn, wait, facts, now=now), facts)
        alone = ""
        if facts["mode"] == "exclusive":
            alone = " to run alone (exclusive: it starts when nothing of the key runs)"
        return Explanation(
            task_id,
            "waiting",
            f"waiting behind {wait['ahead']} others for key {wait['key']}{alone}"
            f" (in flight {wait['in_flight']}/{wait['k']}{_own_limit_text(own)}{_call_limit_text(called)})",
            facts,
        )
    return Explanation(task_id, "waiting", f"waiting for group {wait['group_key']}", facts)


def _fair_text(conn: sa.Connection, wait: Any, facts: dict[str, Any], *, now: datetime | None) -> str:
    """A waiter of a fair name (weighted fair sharing): its fair key's weight, slots held and load,
    and how many fair keys that wait have a lower load (they are served first); ``facts["fair_shares"]``."""
    shares = fair_shares(conn, key=wait["key"], now=now)
    facts["fair_shares"] = [s.as_dict() for s in shares]
    mine = next((s for s in shares if s.fair_key == wait["fair_key"]), None)
    who = "no fair key" if wait["fair_key"] is None else f"fair key {wait['fair_key']}"
    if mine is None:
        return f"waiting for key {wait['key']} (fair; in flight {wait['in_flight']}/{wait['k']})"
    before = sum(1 for s in shares if s.waiting and s.fair_key != mine.fair_key and s.load < mine.load)
    facts.update(fair_weight=mine.weight, fair_holding=mine.holding, fair_load=mine.load, fair_share=mine.share)
    return (
        f"waiting for key {wait['key']} (in flight {wait['in_flight']}/{wait['k']}); fair sharing: {who} weighs "
        f"{mine.weight:g} and holds {mine.holding} slot{'' if mine.holding == 1 else 's'} (its weighted share "
        f"{mine.share:.1f}, load {mine.load:.2f}); {before} waiting fair key{'' if before == 1 else 's'} with a lower "
        f"load go{'es' if before == 1 else ''} first, then its own line of {mine.waiting}"
    )


def _paused_text(wait: Any, own: KeyOverride | None, called: call_limits.CallLimit | None = None) -> str:
    """Why a waiter's key has limit 0: the key's own pause, its own limit 0, its latest call's limit 0, or its
    name's pause."""
    if own is not None and own.paused_until is not None:
        by = f" by {own.pause_author}" if own.pause_author else ""
        return (
            f"key {wait['key']} is paused until {own.paused_until} ({own.pause_reason}{by}); {wait['ahead']} waiting"
            " ahead; the key's line starts again when the pause ends (running tasks of the key go on)"
        )
    if own is not None and own.slot_limit == 0:
        return f"key {wait['key']} has its own limit 0 ({own.reason}); {wait['ahead']} waiting ahead"
    if called is not None and called.in_effect and called.limit == 0:
        return (
            f"key {wait['key']} has limit 0, computed by its latest call (task {called.task_id}, {called.set_at});"
            f" {wait['ahead']} waiting ahead"
        )
    return f"key {wait['key']} is paused (limit 0: its name is paused); {wait['ahead']} waiting ahead"


def _own_limit_text(own: KeyOverride | None) -> str:
    """``; the key's own limit ...`` when the key has one (it replaces its name's)."""
    if own is None or own.slot_limit is None:
        return ""
    until = f" until {own.expires_at}" if own.expires_at is not None else ""
    return f"; the key's own limit{until}: {own.reason}"


def _call_limit_text(called: call_limits.CallLimit | None) -> str:
    """``; the limit its latest call computed ...`` when that is the key's limit now."""
    if called is None or not called.in_effect:
        return ""
    return f"; the limit its latest call computed (task {called.task_id}, {called.set_at})"


def _mode(row: Any) -> str:
    """``concurrency_mode`` of a claim or a parked attempt (readers and writers)."""
    return "exclusive" if is_exclusive(row["cost"]) else "shared"


def _holds(claim: Any) -> str:
    keys = [claim["key"], *(claim["extra_keys"] or [])] if claim["key"] else []
    cost = f"{claim['cost']} slots of " if claim["cost"] and claim["cost"] > 1 else ""
    if _mode(claim) == "exclusive":
        cost = "all of "  # alone on its key
    parts = [
        (f"{cost}key {keys[0]} (shard {claim['shard']})" if len(keys) == 1 else f"{cost}keys {', '.join(keys)}")
        if keys
        else "",
        f"group {claim['group_key']}" if claim["group_key"] else "",
    ]
    return " and ".join(p for p in parts if p)
