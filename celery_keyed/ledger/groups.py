"""Groups: ordered heads per ``group_key`` (tables ``keyed_groups`` and ``keyed_group_members``), D10.

Each task of a group gets a sequence number, allocated in Postgres at publish by ``groups_register`` (in the
producer's transaction when one is open) or at receipt when the producer did not register it. The head of a
group is its member with the lowest number; only the head may run, one attempt at a time (a claim with the
group_key; the unique index ``keyed_claims_one_per_group`` backs the rule). A head in retry backoff keeps its
member row, so the group waits; its final outcome (success, dead-letter, expiry…) deletes the row and the next
number becomes the head. A registered number never received within the arrival timeout is recorded lost and
skipped. Every admission and advance locks the group row first (lock order: after slots and keys).

A group whose name's failure policy is ``hold`` (``keyed_names.group_failure``, read by ``keyed_group_failure``) is
held when its head fails (``GROUPS_HOLD``, by the release of the head): a held group counts as busy in
``GROUPS_HEAD``, so nothing of it starts — not its head's retry, not the next number — until an operator resumes it
(``GROUPS_RESUME``) or skips its head (``group_policies``). See docs/groups.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.errors import translate

# groups_register: allocate the next sequence number of a group for a task id (producer side, or receipt).
GROUPS_REGISTER = sa.text(
    f"""
    WITH g AS (
        INSERT INTO keyed_groups (group_key, next_seq) VALUES (:group_key, 2)
        ON CONFLICT (group_key) DO UPDATE SET next_seq = keyed_groups.next_seq + 1
        RETURNING next_seq - 1 AS seq
    )
    INSERT INTO keyed_group_members (group_key, seq, task_id, received, registered_at)
    SELECT :group_key, g.seq, :task_id, :received, {NOW} FROM g
    RETURNING seq
    """
)

# groups_lock: create if missing and lock the group row (D2: admission and advance lock it unconditionally).
GROUPS_LOCK = sa.text(
    """
    INSERT INTO keyed_groups (group_key) VALUES (:group_key)
    ON CONFLICT (group_key) DO UPDATE SET next_seq = keyed_groups.next_seq
    RETURNING next_seq
    """
)

# groups_try_lock: lock the group row unless another transaction holds it (callers out of lock order).
GROUPS_TRY_LOCK = sa.text("SELECT next_seq FROM keyed_groups WHERE group_key = :group_key FOR UPDATE SKIP LOCKED")

# groups_head: the group's head number, whether an attempt of the group holds its claim, whether it is held for an
# operator (a held group is busy: nothing of it starts).
GROUPS_HEAD = sa.text(
    """
    SELECT (SELECT min(seq) FROM keyed_group_members WHERE group_key = :group_key) AS head,
           EXISTS (SELECT 1 FROM keyed_claims WHERE group_key = :group_key) AS running,
           EXISTS (SELECT 1 FROM keyed_groups WHERE group_key = :group_key AND held_since IS NOT NULL) AS held
    """
)

# groups_failure_policy: what the group does when its head fails (its name's group_failure; 'halt' by default).
GROUPS_FAILURE_POLICY = sa.text("SELECT keyed_group_failure(:group_key)")

# groups_hold: hold the group for an operator after its head failed — only when its name's policy is 'hold' (read
# here, in the statement) and the group is not held already (the first failure's reason stays). Row: held now.
GROUPS_HOLD = sa.text(
    f"""
    UPDATE keyed_groups SET held_since = {NOW}, held_task_id = :task_id, held_reason = :reason
     WHERE group_key = :group_key AND held_since IS NULL AND keyed_group_failure(:group_key) = 'hold'
    RETURNING group_key
    """
)

# groups_block_members: a held group's parked members (its head's retry among them) leave the ready indexes.
GROUPS_BLOCK_MEMBERS = sa.text(
    "UPDATE keyed_waiting SET group_blocked = true WHERE group_key = :group_key AND NOT group_blocked AND NOT shadow"
)

# groups_resume: end the hold of a group (guarded: only a held group, only the hold the caller saw when it names
# one). Row: the hold that ended.
GROUPS_RESUME = sa.text(
    """
    UPDATE keyed_groups g SET held_since = NULL, held_task_id = NULL, held_reason = NULL
      FROM (SELECT group_key, held_since, held_task_id, held_reason FROM keyed_groups
             WHERE group_key = :group_key FOR UPDATE) old
     WHERE g.group_key = old.group_key AND old.held_since IS NOT NULL
       AND (CAST(:task_id AS text) IS NULL OR old.held_task_id = :task_id)
    RETURNING old.held_since, old.held_task_id, old.held_reason
    """
)

# groups_hold_get: the hold of a group (None when it is not held).
GROUPS_HOLD_GET = sa.text(
    """
    SELECT group_key, held_since, held_task_id, held_reason, keyed_group_failure(group_key) AS policy
      FROM keyed_groups WHERE group_key = :group_key AND held_since IS NOT NULL
    """
)

# groups_held: the held groups, oldest hold first, with their members still to run (status).
GROUPS_HELD = sa.text(
    """
    SELECT g.group_key, g.held_since, g.held_task_id, g.held_reason,
           (SELECT count(*) FROM keyed_group_members m WHERE m.group_key = g.group_key) AS members
      FROM keyed_groups g WHERE g.held_since IS NOT NULL
     ORDER BY g.held_since, g.group_key LIMIT :limit
    """
)

# group_members_get: a task's membership (its number), if it has one.
MEMBERS_GET = sa.text("SELECT group_key, seq, received FROM keyed_group_members WHERE task_id = :task_id")
MEMBERS_MARK_RECEIVED = sa.text("UPDATE keyed_group_members SET received = true WHERE task_id = :task_id")

# group_members_finish: a member's final outcome: it leaves the group; the next number may become the head.
MEMBERS_FINISH = sa.text("DELETE FROM keyed_group_members WHERE task_id = :task_id RETURNING group_key, seq")

# group_members_delete_lost: registered numbers never received within the arrival timeout.
MEMBERS_DELETE_LOST = sa.text(
    f"""
    DELETE FROM keyed_group_members m USING (
        SELECT group_key, seq FROM keyed_group_members
         WHERE NOT received AND registered_at < {NOW} - make_interval(secs => :timeout)
         ORDER BY registered_at LIMIT :batch FOR UPDATE SKIP LOCKED) v
     WHERE m.group_key = v.group_key AND m.seq = v.seq
    RETURNING m.group_key, m.seq, m.task_id, m.registered_at
    """
)


def groups_register(
    conn: sa.Connection, group_key: str, task_id: str, *, received: bool = False, now: datetime | None = None
) -> int:
    """Allocate the next number of ``group_key`` for ``task_id``; call it in the producer's transaction so the
    number exists exactly when the task is published. A task id registered before raises :class:`WrongState`
    (the caller's transaction is then aborted, as with any failed statement)."""
    params = {"group_key": group_key, "task_id": task_id, "received": received, "now": now}
    try:
        return int(conn.execute(GROUPS_REGISTER, params).scalar_one())
    except sa.exc.IntegrityError as exc:  # keyed_group_members_task_once: registered already → WrongState
        domain = translate(exc)
        if domain is exc:
            raise
        raise domain from exc


def groups_lock(conn: sa.Connection, group_key: str) -> None:
    conn.execute(GROUPS_LOCK, {"group_key": group_key})


def groups_try_lock(conn: sa.Connection, group_key: str) -> bool:
    return conn.execute(GROUPS_TRY_LOCK, {"group_key": group_key}).first() is not None


def groups_head(conn: sa.Connection, group_key: str) -> tuple[int | None, bool]:
    """(head number or None when the group is empty, whether nothing of it may start: an attempt holds the group,
    or it is held for an operator)."""
    row = conn.execute(GROUPS_HEAD, {"group_key": group_key}).one()
    return row.head, bool(row.running or row.held)


def groups_head_held(conn: sa.Connection, group_key: str) -> tuple[int | None, bool, bool]:
    """(head number or None, whether nothing of it may start, whether it is held for an operator)."""
    row = conn.execute(GROUPS_HEAD, {"group_key": group_key}).one()
    return row.head, bool(row.running or row.held), bool(row.held)


def groups_failure_policy(conn: sa.Connection, group_key: str) -> str:
    """What ``group_key`` does when its head fails: ``halt``, ``skip`` or ``hold`` (its name's ``group_failure``)."""
    return str(conn.execute(GROUPS_FAILURE_POLICY, {"group_key": group_key}).scalar_one())


def groups_hold(
    conn: sa.Connection, group_key: str, task_id: str, *, reason: str, now: datetime | None = None
) -> bool:
    """Hold ``group_key`` (locked by the caller) after its head ``task_id`` failed, when its policy is ``hold`` and it
    is not held yet; its parked members leave the ready indexes. True: held now."""
    params = {"group_key": group_key, "task_id": task_id, "reason": reason, "now": now}
    if conn.execute(GROUPS_HOLD, params).first() is None:
        return False
    conn.execute(GROUPS_BLOCK_MEMBERS, {"group_key": group_key})
    return True


def groups_hold_get(conn: sa.Connection, group_key: str) -> sa.Row[Any] | None:
    return conn.execute(GROUPS_HOLD_GET, {"group_key": group_key}).first()


def members_get(conn: sa.Connection, task_id: str) -> sa.Row[Any] | None:
    return conn.execute(MEMBERS_GET, {"task_id": task_id}).first()


def members_finish(conn: sa.Connection, task_id: str) -> sa.Row[Any] | None:
    return conn.execute(MEMBERS_FINISH, {"task_id": task_id}).first()
