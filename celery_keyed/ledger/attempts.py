"""Attempts: what the ledger is told about an arrival, and what it answers.

A slot belongs to one **attempt** of a task, identified by the attempt token ``(task_id, attempt)`` where
``attempt`` is Celery's retry count; never by task id alone (a retry of the same task id can arrive before
the previous attempt's release).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from celery_keyed.ledger.bounds import SLOT_LIMIT_MAX, is_exclusive


@dataclass(frozen=True)
class Token:
    """The identity of one attempt."""

    task_id: str
    attempt: int


@dataclass(frozen=True)
class Arrival:
    """An attempt as received by a worker (or fed by a test).

    ``key`` is a normalised concurrency key (or None), ``group_key`` the ordered group (or None) and
    ``group_seq`` the sequence number registered at publish (None: allocate at receipt, D10). ``deadline`` is
    Celery's ``expires``; the name's ``max_wait`` may make the latest start earlier. ``not_before`` is an ETA /
    retry countdown. ``message`` is the whole broker message (JSON-able) kept while the attempt is parked.
    Higher ``priority`` is served first. ``extra_keys``: further concurrency keys the attempt needs besides
    ``key`` (all claimed in one transaction or none; it waits in ``key``'s waiting room). ``cost``: slots it
    takes of each of its keys (a weighted slot). ``fair_key``: whose share of a fair name's slots it uses (e.g.
    the tenant). ``cost=EXCLUSIVE_COST`` (``bounds``): an exclusive attempt, alone on its key (readers and
    writers: it starts when nothing of the key runs, and nothing starts while it runs). ``debounce`` (seconds):
    the attempt waits until its key has been quiet that long, and replaces
    (``debounce_keep="last"``) or gives way to (``"first"``) the waiting debounced attempt of its key with the same
    supersede key (else task name), at most ``debounce_max`` seconds after the burst's first arrival (default: 60,
    or ``debounce`` when longer). See ``admit.admit`` and docs/features.md "Debounce". ``on_newer="cancel_running"``
    (newest wins): its arrival asks the worker holding a running (or promoted) attempt of the same first key
    and supersede key (else task name) to cancel it, and replaces the parked ones; see ``admit.admit`` and
    docs/features.md "Newest wins".
    """

    task_id: str
    attempt: int = 0
    key: str | None = None
    group_key: str | None = None
    group_seq: int | None = None
    task_name: str = ""
    priority: int = 0
    deadline: datetime | None = None
    not_before: datetime | None = None
    supersede_key: str | None = None
    queue: str | None = None
    message: Any = field(default_factory=dict)
    extra_keys: tuple[str, ...] = ()
    cost: int = 1
    fair_key: str | None = None
    fair_weight: float | None = None  # its fair key's weight from the call (None: table, else 1; fair_weights.py)
    debounce: float | None = None
    debounce_max: float | None = None
    debounce_keep: str = "last"
    on_newer: str | None = None
    call_limit: int | None = None  # the limit of ``key`` computed from the call (call_limits.py; None: none)

    def __post_init__(self) -> None:
        if self.on_newer is not None:
            self._check_newest_wins()
        if self.debounce is not None:
            self._check_debounce()
        self._check_keys()
        self._check_numbers()

    def _check_newest_wins(self) -> None:
        """``on_newer``: a key, no debounce, and a supersede key (default: the task name, set here)."""
        assert self.on_newer is not None
        check_on_newer(self.on_newer)
        if self.key is None:
            raise ValueError("on_newer='cancel_running' needs a concurrency key")
        if self.debounce is not None:
            raise ValueError("on_newer='cancel_running' and debounce do not combine")
        if self.supersede_key is None:  # newest of the same task on the key, unless a supersede key is given
            object.__setattr__(self, "supersede_key", self.task_name or None)
        if self.supersede_key is None:
            raise ValueError("on_newer='cancel_running' needs a supersede key or a task name")

    def _check_debounce(self) -> None:
        """``debounce``: a key and no group; ``debounce_max`` defaults here."""
        assert self.debounce is not None
        check_debounce(self.debounce, self.debounce_max, self.debounce_keep)
        if self.key is None or self.group_key is not None:
            raise ValueError("debounce needs a concurrency key and no group key")
        if self.debounce_max is None:
            object.__setattr__(self, "debounce_max", max(DEBOUNCE_MAX_DEFAULT, float(self.debounce)))

    def _check_keys(self) -> None:
        if self.key is None and self.group_key is None:
            raise ValueError("an arrival needs a concurrency key or a group key")
        if self.extra_keys and self.key is None:
            raise ValueError("extra_keys need a first key")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"an attempt cannot hold the same key twice: {self.keys!r}")

    def _check_numbers(self) -> None:
        if not isinstance(self.cost, int) or isinstance(self.cost, bool) or self.cost < 1:
            raise ValueError(f"cost must be a positive integer, got {self.cost!r}")
        if self.fair_weight is not None and (
            isinstance(self.fair_weight, bool)
            or not isinstance(self.fair_weight, int | float)
            or not 0 < self.fair_weight < float("inf")
        ):
            raise ValueError(f"fair_weight must be a positive number, got {self.fair_weight!r}")
        if self.call_limit is not None and (
            isinstance(self.call_limit, bool)
            or not isinstance(self.call_limit, int)
            or not 0 <= self.call_limit <= SLOT_LIMIT_MAX
        ):
            raise ValueError(f"call_limit must be an integer from 0 to {SLOT_LIMIT_MAX}, got {self.call_limit!r}")
        if self.call_limit is not None and self.key is None:
            raise ValueError("call_limit needs a concurrency key")
        if not isinstance(self.attempt, int) or isinstance(self.attempt, bool) or self.attempt < 0:
            raise ValueError(f"attempt must be a non-negative integer, got {self.attempt!r}")

    @property
    def token(self) -> Token:
        return Token(self.task_id, self.attempt)

    @property
    def exclusive(self) -> bool:
        """Whether the attempt runs alone on its key (``concurrency_mode="exclusive"``)."""
        return is_exclusive(self.cost)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every concurrency key of the attempt, its first key first."""
        return () if self.key is None else (self.key, *self.extra_keys)

    @property
    def debounce_key(self) -> str | None:
        """What identifies a debounced attempt's burst in its key's line: its supersede key, else its task name."""
        if self.debounce is None:
            return None
        return self.supersede_key if self.supersede_key is not None else self.task_name


#: Seconds a debounced burst may wait at most from its first arrival when ``debounce_max`` is not given (or the
#: debounce period itself when that is longer).
DEBOUNCE_MAX_DEFAULT = 60.0

#: The longest debounce period or maximum wait (100 years, as every duration the ledger's timestamps hold).
_DEBOUNCE_SECONDS_MAX = 3155760000.0


def check_debounce(debounce: Any, debounce_max: Any = None, keep: Any = "last") -> None:
    """Raise ValueError unless ``debounce`` (and ``debounce_max`` when given) are finite positive seconds, the
    maximum at least the period, and ``keep`` is "last" or "first"."""
    for label, value in (("debounce", debounce), ("debounce_max", debounce_max)):
        if value is None and label == "debounce_max":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= _DEBOUNCE_SECONDS_MAX:
            raise ValueError(f"{label} must be a positive number of seconds (at most 100 years), got {value!r}")
    if debounce_max is not None and debounce_max < debounce:
        raise ValueError(f"debounce_max ({debounce_max!r}) must be at least debounce ({debounce!r})")
    if keep not in ("last", "first"):
        raise ValueError(f"debounce_keep must be 'last' or 'first', got {keep!r}")


#: The values of ``on_newer`` besides None (today's behaviour: a newer arrival waits for the running one).
ON_NEWER_POLICIES = ("cancel_running",)


def check_on_newer(value: Any) -> None:
    """Raise ValueError unless ``value`` is None or "cancel_running"."""
    if value is not None and value not in ON_NEWER_POLICIES:
        raise ValueError(f"on_newer must be None or 'cancel_running', got {value!r}")


class Verdict(StrEnum):
    """What admission decided for an arrival."""

    ADMITTED = "admitted"  # a slot is held; run it now (fence given)
    PARKED = "parked"  # stored in the waiting room; ack the broker message
    REJECTED = "rejected"  # waiting room full; final outcome recorded
    EXPIRED = "expired"  # latest start already passed; final outcome recorded
    DUPLICATE = "duplicate"  # the token is known (D8); ack and drop, or kept as a shadow
    SUPERSEDED = "superseded"  # debounced, keep first: the burst's first arrival runs; final outcome recorded


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    fence: int | None = None
    shard: int | None = None
    detail: str = ""
    superseded: tuple[str, ...] = ()  # task ids this arrival replaced in the waiting room
    # Attempts that were ahead of this arrival and started with the room it found (their not-before time had
    # passed, no sweep had run yet): the caller dispatches them, like a release's promotions.
    promotions: tuple[Promotion, ...] = ()
    # Running (or promoted) attempts of the same key and supersede key whose cancellation this arrival asked for
    # (``on_newer="cancel_running"``): (task id, attempt, holder or None).
    cancels: tuple[tuple[str, int, str | None], ...] = ()
    debounced: bool = False  # a debounced arrival: parked for its quiet period, or superseded at arrival (keep first)

    @property
    def admitted(self) -> bool:
        return self.verdict is Verdict.ADMITTED


@dataclass(frozen=True)
class Promotion:
    """A parked attempt that was given a slot. The receiver binds it with ``nonce`` (D5) before running it; a
    promotion without a nonce is already bound to the releaser that asked to run it itself (``LocalHandoff``)."""

    task_id: str
    attempt: int
    nonce: uuid.UUID | None
    fence: int
    key: str | None
    group_key: str | None
    queue: str | None
    message: Any

    @property
    def token(self) -> Token:
        return Token(self.task_id, self.attempt)


class Outcome(StrEnum):
    """How an attempt ended, as told to ``release``."""

    COMPLETED = "completed"  # success: the task is finished
    FAILED = "failed"  # final failure (a group head's final failure is dead-lettered)
    RETRY = "retry"  # this attempt is over; the task comes back as attempt + 1
    WORKER_LOST = "worker_lost"  # the attempt may be redelivered with the same token (D8)
    REVOKED = "revoked"  # revoked while running or while waiting
    DEAD_LETTERED = "dead_lettered"  # explicit dead-letter
    SUPERSEDED = "superseded"  # cancelled by a newer arrival of its key and supersede key (on_newer), then ended


class TaskOutcome(StrEnum):
    """A task's one final outcome in the books (``keyed_tasks.outcome``, D11). The values are the schema's: CHECK
    ``keyed_tasks_outcome_known`` and ``keyed_books_pruned_outcome_known`` list exactly these."""

    COMPLETED = "completed"  # its body succeeded
    FAILED = "failed"  # its body failed for good
    DEAD_LETTERED = "dead_lettered"  # a group head's final failure, or an explicit dead-letter: its group moves on
    EXPIRED = "expired"  # not started before its latest start (expires, max_wait)
    REJECTED = "rejected"  # no place in the waiting room, a cost no key can hold, or unreadable keys (D16)
    SUPERSEDED = "superseded"  # replaced in the waiting room by a newer arrival with its supersede key, or
    # cancelled while running by one (on_newer="cancel_running")
    REVOKED = "revoked"  # revoked while waiting, between attempts, or while running
    LOST = "lost"  # a registered group number never received (D10); not an arrival


@dataclass(frozen=True)
class ReleaseRequest:
    """One release of a batch (``Ledger.release_many``): the arguments of ``Ledger.release`` for one claim.

    ``local_queues`` / ``local_tasks`` (any iterable; kept as frozensets): the caller runs promotions of these
    itself (D4). ``uncertain`` / ``hold``: the attempt ended by a hard time limit or a lost worker."""

    token: Token
    fence: int
    outcome: Outcome
    detail: str = ""
    contended: bool = False
    local_queues: frozenset[str] | None = None
    local_tasks: frozenset[str] | None = None
    uncertain: bool = False
    hold: float | None = None

    def __post_init__(self) -> None:
        if self.local_queues is not None and not isinstance(self.local_queues, frozenset):
            object.__setattr__(self, "local_queues", frozenset(self.local_queues))
        if self.local_tasks is not None and not isinstance(self.local_tasks, frozenset):
            object.__setattr__(self, "local_tasks", frozenset(self.local_tasks))


@dataclass
class ReleaseReport:
    released: bool
    promotions: list[Promotion] = field(default_factory=list)
    finished: list[tuple[str, TaskOutcome]] = field(default_factory=list)  # (task_id, outcome) recorded now
    detail: str = ""  # why a request of a batch was not released (a value the database refused)
