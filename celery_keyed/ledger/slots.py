"""Slots: the per-key, per-shard counters (table ``keyed_slots``).

Invariant (D1): ``used`` of (key, shard) equals the number of claims of (key, shard), and a claim is only
added by a guarded UPDATE ``used < share(effective limit)`` under the row's lock, in the transaction that
inserts the claim. ``CHECK (used >= 0)`` (``keyed_slots_used_nonnegative``) catches a release without a claim.
Lock order: rows of this table by (key, shard) before any ``keyed_keys`` or ``keyed_groups`` row.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from celery_keyed.ledger.bounds import EXCLUSIVE_COST, is_exclusive
from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.waiting import PROMOTABLE_EXISTS

# slots_claim_any: the fast path. Take one slot on any shard of the key that has room, skipping shards other
# transactions hold; no shard = no room seen without waiting (the caller then takes the slow path that locks
# every shard, D2). The guard is repeated in the UPDATE so the bound holds even if the limit changed. Also
# answers the name's shard count (see admit._fast_claim). Never for a rated name: a retry or a redelivery starts
# again, and takes its bucket's tokens and its windows' starts on the general path (admit._take_locked).
SLOTS_CLAIM_ANY = sa.text(
    f"""
    WITH lim AS (
        SELECT keyed_name_shards(:name) AS n,
               COALESCE((SELECT c.rated FROM keyed_names c WHERE c.name = :name), false) AS rated
    ), pick AS (
        SELECT s.shard FROM keyed_slots s, lim
         WHERE NOT lim.rated
           AND s.key = :key AND s.used + :cost <= keyed_row_share(:key, {NOW}, s.shards, lim.n, s.shard)
           AND NOT {PROMOTABLE_EXISTS}
         ORDER BY random() LIMIT 1
         FOR UPDATE OF s SKIP LOCKED
    ), took AS (
        UPDATE keyed_slots s SET used = s.used + :cost
          FROM pick, lim
         WHERE s.key = :key AND s.shard = pick.shard
           AND s.used + :cost <= keyed_row_share(:key, {NOW}, s.shards, lim.n, s.shard)
        RETURNING s.shard
    )
    SELECT (SELECT shard FROM took) AS shard, lim.n AS shards FROM lim
    """
)

# slots_ensure: create the missing counter rows of the key (first use, or after idle drop) for the key's own layout
# (row 0's shard count, the name's current count on first use: keyed_slots_ensure), answering the layout.
SLOTS_ENSURE = sa.text("SELECT keyed_slots_ensure(:key, :name)")

# slots_reshard: move the key's rows to the name's current shard count if every holding fits it (keyed_reshard; the
# caller holds every row's lock). True when it moved.
SLOTS_RESHARD = sa.text(f"SELECT keyed_reshard(:key, {NOW})")

# slots_lock_all: lock every shard row of the key in shard order (the slow path; D2: lock unconditionally),
# returning each shard's use and current share, the rows' layout and the name's configured shard count.
SLOTS_LOCK_ALL = sa.text(
    f"""
    SELECT s.shard, s.used,
           keyed_row_share(:key, {NOW}, s.shards, keyed_name_shards(:name), s.shard) AS share,
           s.shards AS layout, keyed_name_shards(:name) AS target
      FROM keyed_slots s
     WHERE s.key = :key
     ORDER BY s.shard
       FOR UPDATE
    """
)

# slots_lock_one: lock one shard row of a key and return its use and share.
SLOTS_LOCK_ONE = sa.text(
    f"""
    SELECT s.used,
           keyed_row_share(:key, {NOW}, s.shards, keyed_name_shards(:name), s.shard) AS share
      FROM keyed_slots s WHERE s.key = :key AND s.shard = :shard
       FOR UPDATE
    """
)

# The guard of a take of ``cost`` slots of row ``s`` (the bound, D1): ``used + cost <= share``; for an exclusive
# attempt (cost EXCLUSIVE_COST, readers and writers) ``used = 0`` on a key laid out for one shard (so row 0 is its
# only row: every row of the key is empty, D18) of an unsharded, unpaused name instead — it then holds
# EXCLUSIVE_COST, which no other attempt's ``used + cost <= share`` passes until it is given back, and which no
# layout change accepts (keyed_reshard).
_SHARE = f"keyed_row_share(:key, {NOW}, s.shards, keyed_name_shards(:name), s.shard)"
FITS = f"""(CASE WHEN CAST(:cost AS integer) >= {EXCLUSIVE_COST}
                 THEN s.used = 0 AND s.shards = 1 AND keyed_name_shards(:name) = 1 AND {_SHARE} >= 1
                 ELSE s.used + :cost <= {_SHARE} END)"""



def in_flight(used: str) -> str:
    """SQL: the attempts a ``used`` counter stands for, for operators' views — an exclusive holder counts as one
    attempt, not as its EXCLUSIVE_COST slots."""
    return f"({used} % {EXCLUSIVE_COST} + {used} / {EXCLUSIVE_COST})"


# slots_take: add ``cost`` uses to a shard the caller holds locked, if it still has room for them (FITS).
SLOTS_TAKE = sa.text(
    f"""
    UPDATE keyed_slots s SET used = s.used + :cost
     WHERE s.key = :key AND s.shard = :shard AND {FITS}
    RETURNING s.shard
    """
)

# slots_take_nowait: like slots_take for a caller that holds locks later in the lock order (promotion of a
# group head): never waits; no row = busy or full, and the sweep or the lock holder promotes instead.
SLOTS_TAKE_NOWAIT = sa.text(
    f"""
    WITH pick AS (
        SELECT s.shard FROM keyed_slots s
         WHERE s.key = :key AND {FITS}
         ORDER BY s.shard LIMIT 1
         FOR UPDATE OF s SKIP LOCKED
    )
    UPDATE keyed_slots s SET used = s.used + :cost FROM pick
     WHERE s.key = :key AND s.shard = pick.shard
    RETURNING s.shard
    """
)

# slots_give_back: ``cost`` uses less on the shard a deleted claim came from (release credits its own shard,
# D12). Returns how many slots the shard now has free (room for that many promotions).
SLOTS_GIVE_BACK = sa.text(
    f"""
    UPDATE keyed_slots s SET used = s.used - :cost
     WHERE s.key = :key AND s.shard = :shard
    RETURNING GREATEST(keyed_row_share(s.key, {NOW}, s.shards, keyed_name_shards(s.name), s.shard)
                       - s.used, 0) AS free
    """
)

# slots_recount: set a locked shard row to the number of claims that exist for it (reconcile, after locking
# the row in an earlier statement — D1: a single UPDATE ... = (SELECT count) would overwrite a concurrent claim).
# Counted in slots: a claim holds ``cost`` of its first key and of each extra key; a waiter with several keys
# holds ``cost`` of each key it reserved.
SLOTS_COUNT_CLAIMS = sa.text(
    """
    SELECT shard, sum(n) AS n FROM (
        SELECT shard, cost AS n FROM keyed_claims WHERE key = :key AND shard IS NOT NULL
        UNION ALL
        SELECT x.shard, c.cost FROM keyed_claims c,
               unnest(c.extra_keys, c.extra_shards) AS x(key, shard)
         WHERE c.extra_keys @> ARRAY[CAST(:key AS text)] AND x.key = :key
        UNION ALL
        SELECT x.shard, w.cost FROM keyed_waiting w,
               unnest(w.reserved_keys, w.reserved_shards) AS x(key, shard)
         WHERE w.reserved_at IS NOT NULL AND x.key = :key
    ) held GROUP BY shard
    """
)
SLOTS_SET_USED = sa.text("UPDATE keyed_slots SET used = :used WHERE key = :key AND shard = :shard")

# slots_keys_after: the keys with counter rows, in key order after :after (reconcile walks them in batches).
SLOTS_KEYS_AFTER = sa.text("SELECT DISTINCT key FROM keyed_slots WHERE key > :after ORDER BY key LIMIT :batch")

# slots_lock_counters: lock every existing shard row of a key in shard order (reconcile: first lock, then count the
# claims in a later statement, D1), answering each row's counter.
SLOTS_LOCK_COUNTERS = sa.text("SELECT shard, used FROM keyed_slots WHERE key = :key ORDER BY shard FOR UPDATE")

# slots_touch: rewrite every counter row of a key unchanged, under their locks (a key override that can stop claims,
# 0014): a claim waiting for one of them then re-checks its guard against the override (keyed_key_limit reads with a
# fresh snapshot), and one that holds one commits first. So once the override commits, no claim misses it.
SLOTS_TOUCH = sa.text("UPDATE keyed_slots SET used = used WHERE key = :key")

# slots_layouts_behind: keys whose slot rows follow another shard count than their name's current one (the sweep
# moves them once their holdings fit: slots_lock_all, in promote_key). By keyed_slots_layout_idx, name by name: the
# sweep asks it every interval, and a key's rows follow its name's count but for the moments after a change.
SLOTS_LAYOUTS_BEHIND = sa.text(
    """
    SELECT b.key FROM keyed_names c
     CROSS JOIN LATERAL (
           SELECT s.key FROM keyed_slots s
            WHERE s.shard = 0 AND s.name = c.name AND (s.shards < c.shards OR s.shards > c.shards)
            LIMIT :batch) b
    UNION
    SELECT s.key FROM keyed_slots s
     WHERE s.shard = 0 AND s.shards > 1 AND NOT EXISTS (SELECT 1 FROM keyed_names c WHERE c.name = s.name)
    ORDER BY 1 LIMIT :batch
    """
)

# slots_drop_idle: delete the counter rows of a key with nothing held (reconcile; the caller holds the locks).
SLOTS_DROP_KEY = sa.text("DELETE FROM keyed_slots WHERE key = :key AND used = 0")


@dataclass(frozen=True)
class ShardUse:
    shard: int
    used: int
    share: int
    layout: int = 1  # the shard count the key's rows are laid out for (keyed_slots.shards)

    def fits(self, cost: int) -> bool:
        """Room for ``cost`` slots (as FITS; an exclusive attempt needs the key idle: one row, empty — the caller
        rejects it on a sharded name)."""
        if is_exclusive(cost):
            return self.used == 0 and self.layout == 1 and self.share >= 1
        return self.used + cost <= self.share


def slots_lock_all(conn: sa.Connection, key: str, name: str, *, now: datetime | None = None) -> list[ShardUse]:
    """Lock every shard row of the key in shard order and return their use; rows missing (first use, idle drop)
    are created for the key's layout first (slots_ensure), then all are locked again. A key whose rows follow an
    older shard count of its name moves to the current one here when every holding fits it (slots_reshard)."""
    params = {"key": key, "name": name, "now": now}
    rows = conn.execute(SLOTS_LOCK_ALL, params).all()
    if not rows or rows[0].shard != 0 or not set(range(rows[0].layout)) <= {r.shard for r in rows}:
        conn.execute(SLOTS_ENSURE, {"key": key, "name": name})
        rows = conn.execute(SLOTS_LOCK_ALL, params).all()
    if rows and rows[0].layout != rows[0].target and conn.execute(SLOTS_RESHARD, {"key": key, "now": now}).scalar():
        rows = conn.execute(SLOTS_LOCK_ALL, params).all()
    return [ShardUse(r.shard, r.used, r.share, r.layout) for r in rows]


def slots_take(
    conn: sa.Connection, key: str, name: str, shard: int, *, cost: int = 1, now: datetime | None = None
) -> bool:
    """Take ``cost`` slots on a shard the caller holds locked; False when it has no room for them."""
    params = {"key": key, "name": name, "shard": shard, "cost": cost, "now": now}
    return conn.execute(SLOTS_TAKE, params).first() is not None


def slots_take_nowait(
    conn: sa.Connection, key: str, name: str, *, cost: int = 1, now: datetime | None = None
) -> int | None:
    """Take ``cost`` slots on any shard with room that nobody else holds locked, without waiting; the shard or
    None."""
    params = {"key": key, "name": name, "cost": cost, "now": now}
    return conn.execute(SLOTS_TAKE_NOWAIT, params).scalar_one_or_none()


def slots_give_back(conn: sa.Connection, key: str, shard: int, *, cost: int = 1, now: datetime | None = None) -> int:
    """Return ``cost`` slots to (key, shard), locking the row; how many slots the shard has free afterwards."""
    row = conn.execute(SLOTS_GIVE_BACK, {"key": key, "shard": shard, "cost": cost, "now": now}).first()
    return 0 if row is None else int(row.free)
