"""Key normalisation and validation (no database)."""

from __future__ import annotations

import re

import pytest

from celery_keyed.ledger.errors import InvalidKey
from celery_keyed.ledger.keyspec import MAX_KEY_LENGTH, key_name, normalize_key, validate_name


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("account:7", "account:7"),
        ("stripe", "stripe"),
        (("stripe", "tenant-1"), "stripe:tenant-1"),
        (("account", 7), "account:7"),
        ("s3:bucket:path/to", "s3:bucket:path/to"),
        ("a.b-c_d:x", "a.b-c_d:x"),
    ],
)
def test_normalize_accepts(key: object, expected: str) -> None:
    assert normalize_key(key) == expected


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (7, "must be a str or a (name, ident) tuple"),
        (None, "must be a str or a (name, ident) tuple"),
        (["account", 7], "must be a str or a (name, ident) tuple"),
        (("account",), "must be (name, ident)"),
        (("account", 1, 2), "must be (name, ident)"),
        ((7, "x"), "name of a tuple key must be a str"),
        (("account", True), "ident of a tuple key must be a str or int"),
        (("account", 1.5), "ident of a tuple key must be a str or int"),
        (("account", ""), "must not be empty"),
        ("", "must not be empty"),
        ("account:", "empty identity"),
        (":7", "must start with a letter"),
        ("7up:x", "must start with a letter"),
        ("acc ount:1", "must start with a letter"),
        ("account:a b", "whitespace or control"),
        ("account:a\nb", "whitespace or control"),
        ("x" * (MAX_KEY_LENGTH + 1), "at most"),
    ],
)
def test_normalize_rejects_with_a_clear_error(key: object, message: str) -> None:
    with pytest.raises(InvalidKey, match=re.escape(message)):
        normalize_key(key)


def test_longest_key_is_accepted() -> None:
    key = "a:" + "x" * (MAX_KEY_LENGTH - 2)
    assert normalize_key(key) == key


def test_key_name_is_the_part_before_the_first_colon() -> None:
    assert key_name("account:7") == "account"
    assert key_name("s3:bucket:path") == "s3"
    assert key_name("stripe") == "stripe"


@pytest.mark.parametrize("name", ["", "a:b", 7, None, "1abc", "x" * 65])
def test_validate_name_rejects(name: object) -> None:
    with pytest.raises(InvalidKey):
        validate_name(name)
