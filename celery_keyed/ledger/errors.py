"""Domain errors of the ledger. Constraint violations are turned into these by name (see ``translate``)."""

from __future__ import annotations

from typing import Any

import psycopg
import sqlalchemy as sa

#: Longest task id the ledger takes, in characters. Task ids are primary keys: PostgreSQL's B-tree refuses an index
#: row over 2,704 bytes, and 255 characters (at most 1,020 bytes in UTF-8) leave room for a key beside one in a
#: composite index. Celery's ids are 36; its database result backend stores 155.
MAX_TASK_ID_LENGTH = 255


class LedgerError(Exception):
    """Base class of every error the ledger raises on purpose."""


class InvalidKey(LedgerError, ValueError):
    """A concurrency or group key that cannot be used: wrong type, too long, bad characters."""


class InvalidConfig(LedgerError, ValueError):
    """A name's configuration or an override that breaks a rule (negative limit, unknown policy…)."""


class WrongState(LedgerError):
    """A transition was asked of a row that is not in the state it requires."""


class SchemaMissing(LedgerError):
    """The ledger's tables do not exist, or are behind this version: run ``celery keyed migrate`` (or
    ``migrate(engine)``). Raised by ``migrations.schema_missing`` from the database's "undefined table" error."""


#: Named constraints a caller's input can break (a configuration written past the Python checks, e.g. by hand),
#: and the rule each states: they become :class:`InvalidConfig`.
CONFIG_RULES: dict[str, str] = {
    "keyed_names_limit_nonnegative": "a configured limit must be a non-negative integer",
    "keyed_names_shards_range": "shards must be between 1 and 1024",
    "keyed_names_max_waiting_nonnegative": "max_waiting must be a non-negative integer",
    "keyed_names_max_wait_positive": "max_wait must be a positive number of seconds",
    "keyed_names_overflow_known": "overflow must be 'reject' or 'supersede'",
    "keyed_names_uncertain_hold_positive": "uncertain_hold must be a positive number of seconds",
    "keyed_names_rate_positive": "rate must be a positive number of starts per second",
    "keyed_names_burst_with_rate": "burst needs a rate and must be at least 1",
    "keyed_overrides_limit_nonnegative": "an override limit must be a non-negative integer (0 pauses)",
    "keyed_overrides_reason_present": "an override needs a reason",
    "keyed_names_fair_weights_object": "fair_weights must be a table of fair-key prefix -> weight",
    "keyed_waiting_fair_weight_positive": "a fair weight must be a positive number",
    "keyed_fair_weight_overrides_weight_positive": "a fair weight must be a positive number",
    "keyed_fair_weight_overrides_reason_present": "a fair weight override needs a reason",
}

#: Named constraints that state an invariant of the ledger's rows: a statement that breaks one asked a transition
#: of a row that is not in the state it requires (a bug, or a caller repeating a one-time step): :class:`WrongState`.
STATE_RULES: dict[str, str] = {
    "keyed_slots_used_nonnegative": "a slot counter went below zero: a release without a claim (bug)",
    "keyed_keys_waiting_nonnegative": "a waiting counter went below zero: a removal without a park (bug)",
    "keyed_group_members_task_once": "a task id has one number in its group: it is registered already",
    "keyed_claims_one_per_group": "a group runs one attempt at a time: its head holds the group's claim already",
    "keyed_tasks_outcome_known": "a task's outcome must be one of TaskOutcome",
}

#: Every named constraint ``translate`` knows, and its rule (for error messages).
CONSTRAINT_RULES: dict[str, str] = {**CONFIG_RULES, **STATE_RULES}


def translate(exc: BaseException) -> BaseException:
    """Map a database error raised by a named constraint (CHECK, UNIQUE) to its domain error — :class:`InvalidConfig`
    for a configuration rule, :class:`WrongState` for a row-state invariant — naming the rule and the constraint;
    any other error is returned unchanged. Callers raise the result ``from exc``."""
    diag = getattr(getattr(exc, "orig", None), "diag", None)
    name = getattr(diag, "constraint_name", None)
    if name in CONFIG_RULES:
        return InvalidConfig(f"{CONFIG_RULES[name]} ({name})")
    if name in STATE_RULES:
        return WrongState(f"{STATE_RULES[name]} ({name})")
    return exc


def data_refused(orig: BaseException) -> bool:
    """Whether a driver error is PostgreSQL refusing the values of a statement by a limit of its own (SQLSTATE class
    54, "program limit exceeded": an index row over the B-tree's maximum, a statement too complex…). psycopg raises
    these as ``OperationalError``, which the worker's breaker reads as an unreachable database; they are data
    errors of one message, like class 22."""
    return str(getattr(orig, "sqlstate", "") or "").startswith("54")


#: SQLSTATEs psycopg raises as ``ProgrammingError`` that are no fault of the statement: a server-side prepared statement
#: the server connection does not have (26000) or has already (42P05) — a connection pooler in transaction mode gave
#: the transaction to another server connection than the one that prepared it.
_PREPARED_STATEMENT_LOST = frozenset({"26000", "42P05"})

#: SQLSTATE classes the server reports about the ledger's statements or schema, never about the values a message
#: carries (those are bound parameters: class 22 when refused): 42, a table, column or function missing (a schema
#: behind this version), no privilege, a statement of ours wrong; 0A, a feature the server lacks; 3F, a schema missing.
#: The database is not fit for the ledger now — the same as unreachable to a worker (it holds the task and tries again;
#: the error is in its log): never a task's rejection.
_NOT_FIT_CLASSES = frozenset({"42", "0A", "3F"})


def infrastructure_fault(orig: BaseException) -> bool:
    """Whether a driver error says the database, or what stands between us and it, failed — not the statement or its
    values: a lost prepared statement (``_PREPARED_STATEMENT_LOST``) and psycopg's ``InternalError`` (SQLSTATE
    classes 25 and XX: a read-only transaction on a standby, a transaction in an unexpected state, an internal
    error). Raised as ``OperationalError`` (``on_handle_error``), so that the worker treats it as an unreachable
    ledger (held, admitted again) and never books a task as rejected because of it."""
    if isinstance(orig, psycopg.InternalError):
        return True
    sqlstate = str(getattr(orig, "sqlstate", "") or "")
    return sqlstate in _PREPARED_STATEMENT_LOST or sqlstate[:2] in _NOT_FIT_CLASSES


def as_operational_error(statement: Any, params: Any, orig: BaseException) -> sa.exc.OperationalError:
    """``orig`` (see ``infrastructure_fault``) as the ``sqlalchemy.exc.OperationalError`` of an unreachable database."""
    return sa.exc.OperationalError(statement, params, orig)


def as_data_error(statement: Any, params: Any, orig: BaseException) -> sa.exc.DataError:
    """``orig`` (see ``data_refused``) as the ``sqlalchemy.exc.DataError`` a class-22 error would be."""
    return sa.exc.DataError(statement, params, orig)


def on_handle_error(context: Any) -> BaseException | None:
    """The ledger engine's ``handle_error`` listener: a statement PostgreSQL refused by a limit of its own raises a
    ``DataError`` instead of an ``OperationalError`` (``data_refused``); a fault of the database or of a pooler in
    between raises an ``OperationalError`` whatever class psycopg gave it (``infrastructure_fault``)."""
    orig = context.original_exception
    if data_refused(orig):
        return as_data_error(context.statement, context.parameters, orig)
    if infrastructure_fault(orig):
        return as_operational_error(context.statement, context.parameters, orig)
    return None
