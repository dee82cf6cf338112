"""What an operator's write carries besides its numbers: the reason and author kept in the audit trail, an expiry, a
task id to explain. Checked before any statement runs, so a wrong type or text PostgreSQL cannot store is a clear
:class:`InvalidConfig` (a ``ValueError``) naming the argument, never a ``DataError`` or ``ProgrammingError`` from
the driver, and the Python API, ``celery keyed`` and the Django admin accept the same values.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from celery_keyed.ledger.errors import InvalidConfig

#: The longest reason or author kept in the audit trail, in characters (the Django admin's form has the same cap).
MAX_AUDIT_TEXT = 500


def check_audit_text(value: Any, what: str, *, required: bool = False) -> str:
    """A reason or an author: a str of at most ``MAX_AUDIT_TEXT`` characters, without NUL (PostgreSQL's text refuses
    it) or a lone surrogate (it has no UTF-8 form); not blank when ``required``. Else :class:`InvalidConfig`."""
    if not isinstance(value, str):
        raise InvalidConfig(f"{what} must be a str, got {type(value).__name__}: {value!r:.100}")
    if required and not value.strip():
        raise InvalidConfig(f"{what} is required (it is kept in the audit trail)")
    if len(value) > MAX_AUDIT_TEXT:
        raise InvalidConfig(f"{what} must be at most {MAX_AUDIT_TEXT} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidConfig(f"{what} contains a NUL character")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidConfig(f"{what} is not valid Unicode (a lone surrogate)") from None
    return value


def check_expiry(value: Any, what: str = "expires_at") -> datetime | None:
    """An override's expiry: None (none) or a ``datetime``; a naive one is taken as UTC (as ``celery keyed --until``
    takes a time without an offset). Anything else (a number, a string such as "tomorrow", which PostgreSQL would
    have read as a time of its own) is :class:`InvalidConfig`."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidConfig(f"{what} must be a datetime or None, got {type(value).__name__}: {value!r:.100}")
    return value if value.tzinfo is not None and value.utcoffset() is not None else value.replace(tzinfo=UTC)
