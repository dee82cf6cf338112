"""Read-only mirrors of the ledger's tables (``managed = False``): the core owns the schema
(``celery_keyed/ledger/sql``), and tests/django/test_models.py proves these models and the tables agree.

Never write through these models: every change goes through the ledger's functions (``celery_keyed_django.ledger``),
which keep the counters, the audit trail and the promotions right. Tables whose primary key spans several columns
are mirrored with a column the ledger keeps unique as Django's primary key (the admin needs one): a claim's fence
(every claim draws a new one from ``keyed_fence_seq``) and a parked attempt's arrival number (``keyed_arrival_seq``).
"""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models
from django.db.models import Q

from celery_keyed.ledger import OUTCOME_KINDS

#: Final outcomes a task can have in the books (``keyed_tasks.outcome``); NULL while it waits or runs. From the
#: core's one table of outcome kinds.
OUTCOMES = tuple((kind.outcome.value, kind.label) for kind in OUTCOME_KINDS)


class LedgerMigration(models.Model):
    """A version of the ledger's schema applied to this database (``keyed_migrations``)."""

    version = models.TextField(primary_key=True)
    applied_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_migrations"
        default_permissions = ()
        verbose_name = "ledger migration"


class Name(models.Model):
    """A configured name (``keyed_names``), synced from ``keyed_concurrency_limits`` by every worker at start."""

    name = models.TextField(primary_key=True)
    slot_limit = models.IntegerField("configured limit")
    shards = models.IntegerField()
    max_waiting = models.IntegerField(null=True, blank=True)
    max_wait = models.FloatField(null=True, blank=True, help_text="seconds from arrival to the latest start")
    overflow = models.TextField()
    updated_at = models.DateTimeField()
    uncertain_hold = models.FloatField(null=True, blank=True)
    rate = models.FloatField(null=True, blank=True, help_text="tasks per second per key (token bucket)")
    burst = models.FloatField(null=True, blank=True)
    windows = models.JSONField(  # rate windows per key
        null=True, blank=True, help_text="rate windows per key: [[N, seconds], ...], at most N starts in any window"
    )
    cap = models.IntegerField(  # caps and borrowing
        null=True, blank=True, help_text="the most all the keys of the name hold together (its key “name#cap”)"
    )
    borrow = models.BooleanField(help_text="a key may hold up to the cap while no task waits for the cap")
    rated = models.GeneratedField(  # computed by PostgreSQL: a start takes from a bucket, windows or both
        expression=Q(rate__isnull=False) | Q(windows__isnull=False),
        output_field=models.BooleanField(),
        db_persist=True,
    )
    fair = models.BooleanField(help_text="waiters share a key's slots round-robin by their fair key")
    fair_weights = models.JSONField(  # weighted fair sharing (0016)
        null=True, blank=True, help_text="weights by fair-key prefix (keyed_fair_weights); default 1"
    )
    config_version = models.IntegerField(
        "configuration version", help_text="keyed_config_version of the worker that stored it (older never overwrite)"
    )
    group_failure = models.TextField(  # group failure policies (0027)
        help_text="what a group of this name does when its head fails: halt, skip or hold"
    )

    class Meta:
        managed = False
        db_table = "keyed_names"
        default_permissions = ("view",)
        verbose_name = "configured name"
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name


class Override(models.Model):
    """An operator's runtime limit for a name (``keyed_overrides``); 0 pauses the name."""

    name = models.TextField(primary_key=True)
    slot_limit = models.IntegerField("limit")
    reason = models.TextField()
    author = models.TextField()
    expires_at = models.DateTimeField(null=True, blank=True)
    set_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_overrides"
        default_permissions = ("view",)
        permissions = (("change_limits", "Can set, change and clear limit overrides"),)
        verbose_name = "limit override"
        ordering = ("name",)

    def __str__(self) -> str:
        return self.name


class KeyOverride(models.Model):
    """A runtime limit and / or a pause of one key (``keyed_key_overrides``, 0014), set by an operator or by a task of
    the key (``self.keyed_set_limit`` / ``self.keyed_pause``). Rows may hold a part that lapsed already (the sweep
    clears it within a sweep interval): compare ``expires_at`` and ``paused_until`` with now."""

    key = models.TextField(primary_key=True)
    name = models.TextField()
    slot_limit = models.IntegerField("key limit", null=True, blank=True)
    expires_at = models.DateTimeField("limit expires", null=True, blank=True)
    reason = models.TextField(null=True, blank=True)
    author = models.TextField()
    set_at = models.DateTimeField(null=True)
    paused_until = models.DateTimeField(null=True, blank=True)
    pause_reason = models.TextField(null=True, blank=True)
    pause_author = models.TextField()
    paused_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "keyed_key_overrides"
        default_permissions = ("view",)
        verbose_name = "key override"
        ordering = ("key",)

    def __str__(self) -> str:
        return self.key


class OverrideLog(models.Model):
    """The overrides' audit trail (``keyed_override_log``): one row per set, clear or lapse of a name's override, and
    per set, clear, lapse, pause or resume of a key's (``key`` set, 0014)."""

    id = models.BigAutoField(primary_key=True)
    name = models.TextField()
    action = models.TextField()
    old_limit = models.IntegerField(null=True)
    new_limit = models.IntegerField(null=True)
    reason = models.TextField()
    author = models.TextField()
    expires_at = models.DateTimeField(null=True)
    at = models.DateTimeField()
    key = models.TextField(null=True)  # the key of a key override (0014); NULL for a name's

    class Meta:
        managed = False
        db_table = "keyed_override_log"
        default_permissions = ("view",)
        verbose_name = "override change"
        verbose_name_plural = "override changes"
        ordering = ("-at", "-id")


class FairWeightOverride(models.Model):
    """An operator's runtime weight for the fair keys of a name that equal ``prefix`` or start with ``prefix:``
    (``keyed_fair_weight_overrides``, 0016): it wins over the call's weight and the configured table."""

    id = models.BigAutoField(primary_key=True)
    name = models.TextField()
    prefix = models.TextField("fair-key prefix")
    weight = models.FloatField()
    reason = models.TextField()
    author = models.TextField()
    expires_at = models.DateTimeField(null=True, blank=True)
    set_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_fair_weight_overrides"
        default_permissions = ("view",)
        verbose_name = "fair weight override"
        ordering = ("name", "prefix")

    def __str__(self) -> str:
        return f"{self.name} {self.prefix}"


class FairWeightLog(models.Model):
    """The fair weight overrides' audit trail (``keyed_fair_weight_log``): one row per set, clear or lapse."""

    id = models.BigAutoField(primary_key=True)
    name = models.TextField()
    prefix = models.TextField()
    action = models.TextField()
    old_weight = models.FloatField(null=True)
    new_weight = models.FloatField(null=True)
    reason = models.TextField()
    author = models.TextField()
    expires_at = models.DateTimeField(null=True)
    at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_fair_weight_log"
        default_permissions = ("view",)
        verbose_name = "fair weight change"
        verbose_name_plural = "fair weight changes"
        ordering = ("-at", "-id")


class Slot(models.Model):
    """The slot counter of one key and shard (``keyed_slots``): ``used`` = claims held on it."""

    pk = models.CompositePrimaryKey("key", "shard")
    key = models.TextField()
    shard = models.IntegerField()
    name = models.TextField()
    used = models.IntegerField()
    shards = models.IntegerField(help_text="the shard count this key's rows are laid out for")

    class Meta:
        managed = False
        db_table = "keyed_slots"
        default_permissions = ()


class CallLimit(models.Model):
    """The limit of a key its latest call computed (``keyed_call_limits``: a task's ``concurrency_limit``), read by
    every claim after the operators' overrides of the key and of its name."""

    key = models.TextField(primary_key=True)
    name = models.TextField()
    slot_limit = models.IntegerField("limit from the call")
    set_at = models.DateTimeField()
    task_id = models.TextField()
    seen_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_call_limits"
        default_permissions = ()


class RateWindow(models.Model):
    """The rate windows of one key (``keyed_windows``): the position its next start takes in the ring of its latest
    start times, the ring's size and the latest start's time."""

    key = models.TextField(primary_key=True)
    name = models.TextField()
    next_pos = models.BigIntegerField(help_text="the key's starts so far (the position its next start takes)")
    ring = models.IntegerField(help_text="start times kept: the largest N of its name's windows")
    last_at = models.DateTimeField("latest start")

    class Meta:
        managed = False
        db_table = "keyed_windows"
        default_permissions = ()


class RateWindowStart(models.Model):
    """One start time of a key in its windows' ring (``keyed_window_starts``)."""

    pk = models.CompositePrimaryKey("key", "slot")
    key = models.TextField()
    slot = models.IntegerField()
    pos = models.BigIntegerField()
    at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_window_starts"
        default_permissions = ()


class Key(models.Model):
    """A concurrency key the ledger has seen (``keyed_keys``) with its waiting count."""

    key = models.TextField(primary_key=True)
    name = models.TextField()
    waiting = models.IntegerField()
    active_at = models.DateTimeField("last active")
    tokens = models.FloatField(null=True)
    tokens_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "keyed_keys"
        default_permissions = ("view",)
        verbose_name = "key"
        ordering = ("key",)

    def __str__(self) -> str:
        return self.key


class Holder(models.Model):
    """A worker process start (``keyed_holders``): hostname + pid + start nonce."""

    holder = models.TextField(primary_key=True)
    hostname = models.TextField()
    pid = models.IntegerField()
    started_at = models.DateTimeField()
    seen_at = models.DateTimeField()
    machine = models.TextField(null=True)
    pids = ArrayField(models.IntegerField(), null=True)
    config_version = models.IntegerField("configuration version", null=True)

    class Meta:
        managed = False
        db_table = "keyed_holders"
        default_permissions = ("view",)
        verbose_name = "worker"
        ordering = ("-started_at",)

    def __str__(self) -> str:
        return self.holder


class Sent(models.Model):
    """A send accepted at send (``keyed_sent``): its place in its key's waiting room and its dedupe
    key, until its task's final outcome (or, never arrived, until ``expires_at``)."""

    task_id = models.TextField(primary_key=True)
    key = models.TextField()
    dedupe_key = models.TextField(null=True)
    sent_at = models.DateTimeField()
    expires_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_sent"
        default_permissions = ("view",)
        verbose_name = "accepted send"
        ordering = ("-sent_at",)

    def __str__(self) -> str:
        return self.task_id


class SendRefusals(models.Model):
    """Sends refused at send, per name and reason (``keyed_send_refusals``): nothing was published or booked."""

    pk = models.CompositePrimaryKey("name", "reason")
    name = models.TextField()
    reason = models.TextField(choices=(("room_full", "waiting room full"), ("duplicate", "dedupe key live")))
    refused = models.BigIntegerField()
    last_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_send_refusals"
        default_permissions = ("view",)
        verbose_name = "refused sends"
        verbose_name_plural = "refused sends"
        ordering = ("name", "reason")


class Outbox(models.Model):
    """A keyed message registered at publish and not received by a worker yet (``keyed_outbox``):
    the relay publishes it again from this copy when it is due; its row goes when the task arrives."""

    task_id = models.TextField(primary_key=True)
    task_name = models.TextField()
    key = models.TextField(null=True)
    group_key = models.TextField(null=True)
    message = models.JSONField(null=True)  # NULL: a retry registered without a copy (the outbox is off for it)
    registered_at = models.DateTimeField()
    due_at = models.DateTimeField()
    pending = models.BooleanField()
    republished = models.IntegerField()
    republished_at = models.DateTimeField(null=True)
    attempt = models.IntegerField()  # the attempt whose arrival clears the row: 0 first publish, n retry number n
    reported = models.BooleanField()  # an overdue retry reported by reconcile

    class Meta:
        managed = False
        db_table = "keyed_outbox"
        default_permissions = ("view",)
        verbose_name = "registered message not received"
        verbose_name_plural = "outbox: registered, not received"
        ordering = ("registered_at",)

    def __str__(self) -> str:
        return self.task_id


class TaskRecord(models.Model):
    """The books (``keyed_tasks``): one row per keyed task id that arrived, with its final outcome."""

    task_id = models.TextField(primary_key=True)
    task_name = models.TextField()
    key = models.TextField(null=True)
    group_key = models.TextField(null=True)
    arrived_at = models.DateTimeField()
    outcome = models.TextField(null=True, choices=OUTCOMES)
    finished_attempt = models.IntegerField()
    finished_at = models.DateTimeField(null=True)
    detail = models.TextField()
    duplicates = models.IntegerField()
    notified = models.BooleanField()
    message = models.JSONField(
        null=True, help_text="the stored message of a parked task that never ran, kept until its result is stored"
    )
    extra_keys = ArrayField(models.TextField(), null=True, help_text="a task of several keys: its keys after the first")

    class Meta:
        managed = False
        db_table = "keyed_tasks"
        default_permissions = ("view",)
        verbose_name = "task outcome"
        verbose_name_plural = "task outcomes"
        ordering = ("-arrived_at",)

    def __str__(self) -> str:
        return self.task_id


class PrunedTasks(models.Model):
    """Task ids of one outcome pruned from the books after ``keyed_books_retention`` (``keyed_books_pruned``):
    ``Ledger.books()`` adds them back, so the books balance over every task id that ever arrived."""

    outcome = models.TextField(primary_key=True, choices=OUTCOMES)
    tasks = models.BigIntegerField()

    class Meta:
        managed = False
        db_table = "keyed_books_pruned"
        default_permissions = ()
        verbose_name = "pruned task count"

    def __str__(self) -> str:
        return f"{self.outcome}: {self.tasks} pruned"


class Claim(models.Model):
    """A held slot (``keyed_claims``): the right of one attempt to execute. Primary key in the table:
    (task_id, attempt); the fence is unique too (drawn from a sequence for every claim)."""

    task_id = models.TextField()
    attempt = models.IntegerField()
    key = models.TextField(null=True)
    shard = models.IntegerField(null=True)
    group_key = models.TextField(null=True)
    state = models.TextField()
    fence = models.BigIntegerField(primary_key=True)
    holder = models.TextField(null=True)
    nonce = models.UUIDField(null=True)
    dispatch_deadline = models.DateTimeField(null=True)
    lease_expires_at = models.DateTimeField()
    claimed_at = models.DateTimeField()
    parked = models.JSONField(null=True)
    cost = models.IntegerField()
    extra_keys = ArrayField(models.TextField(), null=True)
    extra_shards = ArrayField(models.IntegerField(), null=True)
    held_outcome = models.TextField(null=True)
    fair_key = models.TextField(null=True)
    supersede_key = models.TextField(null=True)  # newest wins (0015)
    cancel_requested_at = models.DateTimeField(null=True)  # a newer arrival asked for its cancellation (0015)
    cancel_detail = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = "keyed_claims"
        default_permissions = ("view",)
        permissions = (("force_release", "Can force-release a claim (a recorded breach if its holder is alive)"),)
        verbose_name = "claim"
        ordering = ("claimed_at",)

    def __str__(self) -> str:
        return f"{self.task_id} attempt {self.attempt}"


class Waiting(models.Model):
    """A parked attempt (``keyed_waiting``). Primary key in the table: (task_id, attempt); the arrival number is
    unique too (drawn from a sequence for every park, kept when a voided promotion goes back in line)."""

    task_id = models.TextField()
    attempt = models.IntegerField()
    key = models.TextField(null=True)
    group_key = models.TextField(null=True)
    group_seq = models.BigIntegerField(null=True)
    priority = models.IntegerField()
    arrival = models.BigIntegerField(primary_key=True)
    arrived_at = models.DateTimeField()
    not_before = models.DateTimeField(null=True)
    deadline = models.DateTimeField(null=True)
    supersede_key = models.TextField(null=True)
    shadow = models.BooleanField()
    group_blocked = models.BooleanField()
    queue = models.TextField(null=True)
    message = models.JSONField()
    keys = ArrayField(models.TextField(), null=True)
    cost = models.IntegerField()
    reserved_keys = ArrayField(models.TextField(), null=True)
    reserved_shards = ArrayField(models.IntegerField(), null=True)
    reserved_at = models.DateTimeField(null=True)
    fair_key = models.TextField(null=True)
    debounce_key = models.TextField(null=True)  # debounce (0011): the burst's identity in its line
    debounce_cap = models.DateTimeField(null=True)  # debounce (0011): the burst's latest due time
    fair_weight = models.FloatField(null=True)  # weighted fair sharing (0016): the weight the call carries

    class Meta:
        managed = False
        db_table = "keyed_waiting"
        default_permissions = ("view",)
        permissions = (("cancel_waiting", "Can cancel (revoke) a waiting task"),)
        verbose_name = "waiting task"
        ordering = ("arrival",)

    def __str__(self) -> str:
        return f"{self.task_id} attempt {self.attempt}"


class Group(models.Model):
    """An ordered group (``keyed_groups``) and its sequence counter."""

    group_key = models.TextField(primary_key=True)
    next_seq = models.BigIntegerField()
    held_since = models.DateTimeField(
        null=True, blank=True, help_text="held for an operator since (group_failure hold)"
    )
    held_task_id = models.TextField(null=True, blank=True, help_text="the head whose failure held the group")
    held_reason = models.TextField(null=True, blank=True)

    class Meta:
        managed = False
        db_table = "keyed_groups"
        default_permissions = ()


class HeldGroup(Group):
    """The admin's view of the held groups: a group of a name whose ``group_failure`` is ``hold``, held since its head
    failed, until an operator resumes it or skips its head."""

    class Meta:
        proxy = True
        default_permissions = ("view",)
        permissions = (("release_groups", "Can resume held groups and skip their failed heads"),)
        verbose_name = "held group"
        ordering = ("held_since", "group_key")

    def __str__(self) -> str:
        return self.group_key


class GroupMember(models.Model):
    """A member of an ordered group (``keyed_group_members``); the head is the lowest seq."""

    group_key = models.TextField()
    seq = models.BigIntegerField()
    task_id = models.TextField(primary_key=True)
    received = models.BooleanField()
    registered_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_group_members"
        default_permissions = ()


class Event(models.Model):
    """A ledger fact for operators (``keyed_events``): drift repaired, forced releases (recorded breaches),
    reclaimed leases, duplicate deliveries."""

    id = models.BigAutoField(primary_key=True)
    kind = models.TextField()
    key = models.TextField(null=True)
    task_id = models.TextField(null=True)
    detail = models.TextField()
    at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "keyed_events"
        default_permissions = ("view",)
        verbose_name = "ledger event"
        ordering = ("-at", "-id")


class LedgerIdentity(models.Model):
    """The identity of the server that last wrote the ledger (``keyed_ledger_identity``, one row): a change is a
    failover, and new starts wait until ``hold_until``."""

    one_row = models.BooleanField(primary_key=True, default=True)
    system_identifier = models.BigIntegerField()
    timeline = models.IntegerField()
    postmaster_start = models.DateTimeField()
    seen_at = models.DateTimeField()
    hold_until = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "keyed_ledger_identity"
        default_permissions = ("view",)
        verbose_name = "ledger identity"
        verbose_name_plural = "ledger identity"
