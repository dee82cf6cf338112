"""The one-statement fast paths: a claim or a release that touches the books (``keyed_tasks``), the slot counters
(``keyed_slots``) and the claims (``keyed_claims``) in one self-committing statement, with the same guards and the
same lock order as the transactions of ``admit`` and ``release`` (task row first, then slot rows by (key, shard)).
Used by ``admit.admit_autocommit`` / ``admit.admit`` and ``release.release`` / ``release.release_autocommit``.
"""

from __future__ import annotations

import sqlalchemy as sa

from celery_keyed.ledger.clock import NOW
from celery_keyed.ledger.waiting import PROMOTABLE_EXISTS

# claim_new: the fast path of a first arrival, in one statement: record the arrival (or lock the task's row,
# as ARRIVE_OR_LOCK) and, for a new task id that has not expired, take a slot on any shard with room that no
# other transaction holds and insert the claim. The task row is locked before any slot row (lock order): the
# slot rows are only reached through the join with ``arr``. Also returns the name's shard count (see
# admit._fast_claim for why it matters).
_CLAIM_NEW = """
    WITH arr AS (
        INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at)
        VALUES (:task_id, :task_name, :key, NULL, {NOW})
        ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
        RETURNING (xmax = 0) AS new, outcome, finished_attempt,
                  COALESCE(CAST(:deadline AS timestamptz) <= {NOW}, false) AS expired
    ), lim AS (
        SELECT keyed_name_shards(:name) AS n,
               COALESCE((SELECT c.rated FROM keyed_names c WHERE c.name = :name), false) AS rated
    ), pick AS (
        SELECT s.shard FROM keyed_slots s, lim, arr
         WHERE arr.new AND NOT arr.expired AND NOT lim.rated
           AND s.key = :key AND s.used + :cost <= keyed_row_share(:key, {NOW}, s.shards, lim.n, s.shard)
           AND NOT {PROMOTABLE}
         ORDER BY random() LIMIT 1
         FOR UPDATE OF s {lock_wait}
    ), took AS (
        UPDATE keyed_slots s SET used = s.used + :cost
          FROM pick, lim
         WHERE s.key = :key AND s.shard = pick.shard
           AND s.used + :cost <= keyed_row_share(:key, {NOW}, s.shards, lim.n, s.shard)
        RETURNING s.shard
    ), claimed AS (
        INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                  lease_expires_at, claimed_at, cost, fair_key)
        SELECT :task_id, :attempt, :key, took.shard, NULL, 'running', nextval('keyed_fence_seq'), :holder,
               {NOW} + make_interval(secs => :lease), {NOW}, :cost, :fair_key
          FROM took
        RETURNING fence, shard
    )
    SELECT arr.new, arr.outcome, arr.finished_attempt, arr.expired, lim.n AS shards,
           (SELECT fence FROM claimed) AS fence, (SELECT shard FROM claimed) AS shard
      FROM arr, lim
    """
_CLAIM_NEW = _CLAIM_NEW.replace("{PROMOTABLE}", PROMOTABLE_EXISTS).replace("{NOW}", NOW)
CLAIM_NEW = sa.text(_CLAIM_NEW.replace("{lock_wait}", "SKIP LOCKED"))
# claim_new_waiting: the same for a name with one shard: wait for its only row like any counter update (a
# lock it keeps after a failed re-check is the first in the lock order anyway).
CLAIM_NEW_WAITING = sa.text(_CLAIM_NEW.replace("{lock_wait}", ""))

# claim_new_multi: the fast path of a first arrival with several keys, in one statement, all or nothing: for
# every key pick a shard with room for ``cost`` that no other transaction holds (SKIP LOCKED: never waits, so
# no lock order is needed) and that no one waits for; only when every key got one are they all taken and the
# claim inserted. A row locked by the pick was re-checked under its lock (and nobody else can change it while
# it is held; the limits are read in this statement's snapshot), so the take cannot fail for one of them. A
# miss changes nothing and its locks end with the statement (autocommit).
CLAIM_NEW_MULTI = sa.text(
    f"""
    WITH arr AS (
        INSERT INTO keyed_tasks (task_id, task_name, key, group_key, arrived_at, extra_keys)
        VALUES (:task_id, :task_name, :key, NULL, {NOW}, CAST(:extra_keys AS text[]))
        ON CONFLICT (task_id) DO UPDATE SET task_id = excluded.task_id
        RETURNING (xmax = 0) AS new, outcome, finished_attempt,
                  COALESCE(CAST(:deadline AS timestamptz) <= {NOW}, false) AS expired
    ), want AS (
        SELECT w.key, w.ord, split_part(w.key, ':', 1) AS name
          FROM unnest(CAST(:keys AS text[])) WITH ORDINALITY AS w(key, ord)
    ), lim AS (
        SELECT want.key, want.ord, keyed_name_shards(want.name) AS n,
               COALESCE((SELECT c.rated FROM keyed_names c WHERE c.name = want.name), false) AS rated
          FROM want
    ), pick AS (
        SELECT lim.key, lim.ord, p.shard
          FROM arr, lim, LATERAL (
               SELECT s.shard FROM keyed_slots s
                WHERE s.key = lim.key AND s.used + :cost <= keyed_row_share(lim.key, {NOW}, s.shards, lim.n, s.shard)
                  AND NOT EXISTS (
                      SELECT 1 FROM keyed_waiting w
                       WHERE w.key = lim.key AND NOT w.shadow AND (w.not_before IS NULL OR w.not_before <= {NOW})
                         AND NOT w.group_blocked AND (w.deadline IS NULL OR w.deadline > {NOW}))
                ORDER BY random() LIMIT 1
                FOR UPDATE OF s SKIP LOCKED) p
         WHERE arr.new AND NOT arr.expired AND NOT lim.rated
    ), complete AS (
        SELECT count(*) = cardinality(CAST(:keys AS text[])) AS ok FROM pick
    ), took AS (
        UPDATE keyed_slots s SET used = s.used + :cost
          FROM pick, complete
         WHERE complete.ok AND s.key = pick.key AND s.shard = pick.shard
        RETURNING s.key
    ), claimed AS (
        INSERT INTO keyed_claims (task_id, attempt, key, shard, group_key, state, fence, holder,
                                  lease_expires_at, claimed_at, cost, extra_keys, extra_shards, fair_key)
        SELECT :task_id, :attempt, :key, (SELECT shard FROM pick WHERE ord = 1), NULL, 'running',
               nextval('keyed_fence_seq'), :holder, {NOW} + make_interval(secs => :lease), {NOW}, :cost,
               CAST(:extra_keys AS text[]), ARRAY(SELECT shard FROM pick WHERE ord > 1 ORDER BY ord), :fair_key
          FROM complete WHERE complete.ok
        RETURNING fence, shard
    )
    SELECT arr.new, arr.outcome, arr.finished_attempt, arr.expired, 1 AS shards,
           (SELECT fence FROM claimed) AS fence, (SELECT shard FROM claimed) AS shard
      FROM arr
    """
)

# release_fast: the release of a claim without a group, in one statement: delete the claim (only the owner
# of this exact fence gets the row: release exactly once), record the outcome in the books, give every slot it
# held back to the shard it came from (its first key and any extra keys, ``cost`` each). ``b`` is joined
# before the slot rows are locked so the task row is locked first, and the slot rows are locked in (key,
# shard) order (lock order). Whether anyone waits is NOT read here: this statement's snapshot predates the wait
# for the slot rows' locks; the caller reads it in a later statement (D2).
RELEASE_FAST = sa.text(
    f"""
    WITH c AS (
        DELETE FROM keyed_claims
         WHERE task_id = :task_id AND attempt = :attempt AND fence = :fence AND state = 'running'
           AND group_key IS NULL
        RETURNING task_id, attempt, key, shard, fence, cost, extra_keys, extra_shards
    ), b AS (
        UPDATE keyed_tasks t
           SET outcome = COALESCE(t.outcome, CAST(:final AS text)),
               finished_at = COALESCE(t.finished_at, CASE WHEN CAST(:final AS text) IS NOT NULL THEN {NOW} END),
               detail = CASE WHEN t.outcome IS NULL AND CAST(:final AS text) IS NOT NULL THEN :detail
                             ELSE t.detail END,
               finished_attempt = GREATEST(t.finished_attempt, c.attempt)
          FROM c
         WHERE t.task_id = c.task_id AND :over AND (CAST(:final AS text) IS NULL OR t.outcome IS NULL)
        RETURNING t.task_id, CAST(:final AS text) IS NOT NULL AS recorded
    ), held AS (
        SELECT c.key, c.shard, c.cost FROM c WHERE c.key IS NOT NULL
        UNION ALL
        SELECT x.key, x.shard, c.cost FROM c, unnest(c.extra_keys, c.extra_shards) AS x(key, shard)
    ), lk AS MATERIALIZED (
        SELECT sl.key, sl.shard, h.cost FROM keyed_slots sl
          JOIN held h ON h.key = sl.key AND h.shard = sl.shard
          LEFT JOIN b ON true
         ORDER BY sl.key, sl.shard
           FOR UPDATE OF sl
    ), s AS (
        UPDATE keyed_slots sl SET used = sl.used - lk.cost
          FROM lk
         WHERE sl.key = lk.key AND sl.shard = lk.shard
        RETURNING sl.key, sl.shard,
                  GREATEST(keyed_row_share(sl.key, {NOW}, sl.shards, keyed_name_shards(sl.name), sl.shard)
                           - sl.used, 0) AS free
    )
    SELECT c.task_id, c.attempt, c.key, c.shard, c.fence,
           ARRAY(SELECT s.key FROM s WHERE s.free > 0 ORDER BY s.key, s.shard) AS room_keys,
           ARRAY(SELECT s.shard FROM s WHERE s.free > 0 ORDER BY s.key, s.shard) AS room_shards,
           ARRAY(SELECT s.free FROM s WHERE s.free > 0 ORDER BY s.key, s.shard) AS room_free,
           COALESCE((SELECT recorded FROM b), false) AS recorded,
           EXISTS (SELECT 1 FROM keyed_waiting w
                    WHERE w.task_id = c.task_id AND w.attempt = c.attempt AND w.shadow) AS has_shadow
      FROM c
    """
)

# -- server-side paths (migrations 0005 and 0007: sql/migrations/0005_server_paths.sql and 0007_release_and_promote.sql
# hold their bodies and the rules each enforces; every one keeps the lock order and the guards of the statements
# above) -------------------------------------------------------------------------------------------------------

# claim_many: the fast claim of a batch of single-key arrivals in one call (Ledger.admit_many): one row per input
# position (1-based ``ord``), admitted with its fence and shard, or not (the caller admits those one by one, in
# input order: FIFO within a key, D10).
CLAIM_MANY = sa.text(
    """
    SELECT ord, new, fence, shard FROM keyed_claim_many(
        CAST(:task_ids AS text[]), CAST(:attempts AS integer[]), CAST(:task_names AS text[]), CAST(:keys AS text[]),
        CAST(:deadlines AS timestamptz[]), CAST(:costs AS integer[]), CAST(:fair_keys AS text[]), :holder,
        CAST(:lease AS double precision), CAST(:now AS timestamptz))
    """
)

# release_and_promote: the release of a batch of claims without a group, the waiter check after it (D2) and the
# promotion of the rooms it freed, in one self-committing call (migration 0007: keyed_release_many, then
# keyed_promote_plain, in one transaction). Rows: kind 'release' one per input position (1-based ``ord``), then
# 'promotion' one per promoted attempt, then 'general' naming a key whose line the general promotion
# (promote.promote_waiters) continues. ``local_sets`` (JSON: [{"queues": [...], "tasks": [...]}, ...]) and
# ``local_set`` (per request, 0-based into it, or NULL) say which promotions the releasers run themselves (D4).
RELEASE_AND_PROMOTE = sa.text(
    """
    SELECT kind, ord, released, recorded, has_shadow, key, room_keys, room_shards, task_id, attempt, nonce, fence,
           shard, queue, message
      FROM keyed_release_and_promote(
        CAST(:task_ids AS text[]), CAST(:attempts AS integer[]), CAST(:fences AS bigint[]), CAST(:finals AS text[]),
        CAST(:details AS text[]), CAST(:now AS timestamptz), CAST(:dispatch AS double precision), :local_holder,
        CAST(:local_lease AS double precision), CAST(:local_sets AS jsonb), CAST(:local_set AS integer[]))
    """
)

# park_plain: park one plain arrival at receipt when its key has a line or no room (keyed_admit_or_park_plain with
# p_park_only): 'parked', 'rejected', or 'undecided' / 'general' (left to its admission at pool-ready; no slot taken).
PARK_PLAIN = sa.text(
    """
    SELECT verdict, new, fence, shard, detail FROM keyed_admit_or_park_plain(
        :task_id, :attempt, :task_name, :key, :priority, CAST(:deadline AS timestamptz), :queue,
        CAST(:message AS jsonb), :fair_key, :holder, CAST(:lease AS double precision), CAST(:now AS timestamptz),
        true)
    """
)

# admit_plain: admit-or-park of one plain arrival (one key, no group, no not-before, cost 1, no supersede key) in
# one call: 'admitted', 'parked', 'rejected', or 'general' (admit.admit decides).
ADMIT_PLAIN = sa.text(
    """
    SELECT verdict, new, fence, shard, detail FROM keyed_admit_plain(
        :task_id, :attempt, :task_name, :key, :priority, CAST(:deadline AS timestamptz), :queue,
        CAST(:message AS jsonb), :fair_key, :holder, CAST(:lease AS double precision), CAST(:now AS timestamptz))
    """
)

# admit_plain_many: admit-or-park of a batch of plain arrivals in one round trip, one transaction per arrival
# (migration 0019: the procedure keyed_admit_plain_many commits after each; ``conn`` must be in autocommit). One
# answer per input position in the INOUT arrays: verdict ('admitted', 'parked', 'rejected', 'general', 'undecided',
# 'error', 'skipped'), new, fence, shard, detail. ``park_only``: the receipt service's park (never takes a slot, D3);
# ``in_order``: after the first arrival it leaves undecided, every later one is skipped.
ADMIT_PLAIN_MANY = sa.text(
    """
    CALL keyed_admit_plain_many(
        CAST(:task_ids AS text[]), CAST(:attempts AS integer[]), CAST(:task_names AS text[]), CAST(:keys AS text[]),
        CAST(:priorities AS integer[]), CAST(:deadlines AS timestamptz[]), CAST(:queues AS text[]),
        CAST(:messages AS text[]), CAST(:fair_keys AS text[]), :holder, CAST(:lease AS double precision),
        CAST(:now AS timestamptz), :park_only, :in_order, NULL, NULL, NULL, NULL, NULL)
    """
)
