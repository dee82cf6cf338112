"""Parsing of the ``keyed_concurrency_limits`` setting (no database)."""

from __future__ import annotations

import pytest

from celery_keyed.ledger.errors import InvalidConfig, InvalidKey
from celery_keyed.ledger.names import NameConfig, parse_limits


def test_parse_int_and_dict_forms() -> None:
    configs = parse_limits(
        {
            "stripe": {"limit": 100, "shards": 10},
            "research": {"limit": 2, "max_waiting": 3, "max_wait": 6.0},
            "mail": 5,
        }
    )
    assert configs["stripe"] == NameConfig("stripe", limit=100, shards=10)
    assert configs["research"] == NameConfig("research", limit=2, max_waiting=3, max_wait=6.0)
    assert configs["mail"].limit == 5
    assert parse_limits(None) == {}


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"x": -1}, "limit must be at least 0"),
        ({"x": 1.5}, "must be an int or a dict"),
        ({"x": True}, "must be an int or a dict"),
        ({"x": {"limit": "3"}}, "limit must be an integer"),
        ({"x": {"limit": 2, "shards": 0}}, "shards must be at least 1"),
        ({"x": {"limit": 2, "shards": 2000}}, "at most 1024"),
        ({"x": {"limit": 2, "max_waiting": -1}}, "max_waiting must be at least 0"),
        ({"x": {"limit": 2, "max_wait": 0}}, "max_wait must be a positive"),
        ({"x": {"limit": 2, "max_wait": float("inf")}}, "max_wait must be a positive"),
        ({"x": {"limit": 2, "overflow": "drop"}}, "overflow must be"),
        ({"x": {"limt": 2}}, "unknown option"),
        ([("x", 1)], "must be a dict by name"),
    ],
)
def test_bad_settings_are_clear_errors(setting: object, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        parse_limits(setting)  # type: ignore[arg-type]


def test_bad_name_is_a_key_error() -> None:
    with pytest.raises(InvalidKey):
        parse_limits({"a:b": 1})
