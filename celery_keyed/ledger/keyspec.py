"""Concurrency and group keys: normalisation and validation.

A key is ``"name:ident"`` or a tuple ``("name", ident)`` normalised to ``"name:ident"``; a key without ``:``
is its own name. Configuration (limit, shards, waiting room) is looked up by the name, the part before the
first ``:``. Keys are validated before they reach the ledger so that a bad key is a clear error at the
producer (or a recorded rejection at the worker), never a lost task.
"""

from __future__ import annotations

import re
from typing import Any

from celery_keyed.ledger.errors import MAX_TASK_ID_LENGTH, InvalidKey

#: Longest key accepted, in characters. Keys are primary-key columns; 200 leaves room for index tuples.
MAX_KEY_LENGTH = 200

#: Most concurrency keys one call may carry. Each is one row lock in the admission's transaction (a claim of 5,000
#: keys took 7.7 s, holding the worker's admission thread), so a foreign message cannot list thousands.
MAX_KEYS_PER_CALL = 32

#: A name: starts with a letter, then letters, digits, ``_ . -``. Names appear in settings and metrics labels.
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]{0,63}$")

#: An identity: printable, no whitespace or control characters (they make keys unreadable in the admin).
_IDENT_RE = re.compile(r"^[^\s\x00-\x1f\x7f]+$")

#: Identity parts may be any of these types; they are rendered with ``str()``.
_IDENT_TYPES = (str, int)


def normalize_key(key: Any) -> str:
    """Return the canonical ``"name:ident"`` string for ``key`` or raise :class:`InvalidKey`.

    Accepts a string (``"account:7"`` or a bare name ``"stripe"``) or a 2-tuple ``(name, ident)`` whose ident
    is a ``str`` or ``int`` (``bool`` is refused: ``True`` is almost always a bug). Nested ``:`` in the
    identity are kept (``"s3:bucket:path"`` has name ``s3``).
    """
    if isinstance(key, tuple):
        if len(key) != 2:
            raise InvalidKey(f"a tuple key must be (name, ident), got {len(key)} parts: {key!r}")
        name, ident = key
        if not isinstance(name, str):
            raise InvalidKey(f"the name of a tuple key must be a str, got {type(name).__name__}: {key!r}")
        if isinstance(ident, bool) or not isinstance(ident, _IDENT_TYPES):
            raise InvalidKey(f"the ident of a tuple key must be a str or int, got {type(ident).__name__}: {key!r}")
        ident_text = str(ident)
        if ident_text == "":
            raise InvalidKey(f"the ident of a tuple key must not be empty: {key!r}")
        text = f"{name}:{ident_text}"
    elif isinstance(key, str):
        text = key
    else:
        raise InvalidKey(f"a key must be a str or a (name, ident) tuple, got {type(key).__name__}: {key!r}")
    return validate_key(text)


def validate_key(text: str) -> str:
    """Check a key string and return it unchanged, or raise :class:`InvalidKey`."""
    if not text:
        raise InvalidKey("a key must not be empty")
    if len(text) > MAX_KEY_LENGTH:
        raise InvalidKey(f"a key must be at most {MAX_KEY_LENGTH} characters, got {len(text)}: {text[:40]!r}…")
    name, sep, ident = text.partition(":")
    if not _NAME_RE.match(name):
        raise InvalidKey(
            f"the name {name!r} of key {text!r} must start with a letter and contain only letters, digits, "
            "'_', '.', '-' (at most 64 characters)"
        )
    if sep and not ident:
        raise InvalidKey(f"the key {text!r} has an empty identity after ':'")
    if sep and not _IDENT_RE.match(ident):
        raise InvalidKey(f"the identity of key {text!r} contains whitespace or control characters")
    if not ident.isascii():
        try:
            ident.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate ("\ud800" in JSON): no UTF-8 form, PostgreSQL cannot store it
            raise InvalidKey(f"the identity of key {text!r} is not valid Unicode (a lone surrogate)") from None
    return text


def key_name(key: str) -> str:
    """The name (pool) of a normalised key: the part before the first ``:``."""
    return key.partition(":")[0]


def validate_name(name: Any) -> str:
    """Check a configured name (no ``:``) and return it, or raise :class:`InvalidKey`."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidKey(
            f"a name must be a str that starts with a letter and contains only letters, digits, '_', '.', '-' "
            f"(at most 64 characters), got {name!r}"
        )
    return name


def validate_task_id(task_id: Any) -> None:
    """A task id the ledger can store: a non-empty str of at most ``MAX_TASK_ID_LENGTH`` characters with no NUL and
    no lone surrogate. Else :class:`InvalidKey`: at the producer for a keyed call's ``task_id=``, at the worker for a
    foreign producer's (one over PostgreSQL's index row size made every admission of it fail as if the database
    were down)."""
    if not isinstance(task_id, str) or not task_id:
        raise InvalidKey(f"the task id must be a non-empty str, got {task_id!r:.100}")
    if len(task_id) > MAX_TASK_ID_LENGTH:
        raise InvalidKey(f"the task id has {len(task_id)} characters; the ledger takes at most {MAX_TASK_ID_LENGTH}")
    if "\x00" in task_id:
        raise InvalidKey("the task id contains a NUL character")
    if not task_id.isascii():
        try:
            task_id.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidKey("the task id is not valid Unicode (a lone surrogate)") from None
