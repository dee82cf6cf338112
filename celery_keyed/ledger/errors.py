"""Domain errors of the ledger. Constraint violations are turned into these by name (see ``translate``)."""

from __future__ import annotations


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


#: Named CHECK constraints of the schema and the rule each states, for error messages.
CONSTRAINT_RULES: dict[str, str] = {
    "keyed_names_limit_nonnegative": "a configured limit must be a non-negative integer",
    "keyed_names_shards_range": "shards must be between 1 and 1024",
    "keyed_names_max_waiting_nonnegative": "max_waiting must be a non-negative integer",
    "keyed_names_max_wait_positive": "max_wait must be a positive number of seconds",
    "keyed_names_overflow_known": "overflow must be 'reject' or 'supersede'",
    "keyed_overrides_limit_nonnegative": "an override limit must be a non-negative integer (0 pauses)",
    "keyed_overrides_reason_present": "an override needs a reason",
    "keyed_slots_used_nonnegative": "a slot counter went below zero: a release without a claim (bug)",
    "keyed_keys_waiting_nonnegative": "a waiting counter went below zero: a removal without a park (bug)",
}


def translate(exc: BaseException) -> BaseException:
    """Map a database error raised by a named CHECK constraint to :class:`InvalidConfig`, else return it."""
    diag = getattr(getattr(exc, "orig", None), "diag", None)
    name = getattr(diag, "constraint_name", None)
    if name in CONSTRAINT_RULES:
        return InvalidConfig(f"{CONSTRAINT_RULES[name]} ({name})")
    return exc
