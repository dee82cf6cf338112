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


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"limit": 10**12}, "x: limit must be at least 0 and at most 1073741823, got 1000000000000"),
        ({"limit": 2**63}, "x: limit must be at least 0 and at most 1073741823"),
        ({"max_waiting": 2**40}, "x: max_waiting must be at least 0 and at most 2147483647"),
        ({"max_waiting": 1.5}, "x: max_waiting must be an integer"),
        ({"max_wait": 1e300}, r"x: max_wait must be a positive number of seconds, at most 3155760000, got 1e\+300"),
        ({"max_wait": float("nan")}, "x: max_wait must be a positive number of seconds"),
        ({"max_wait": -1}, "x: max_wait must be a positive number of seconds"),
        ({"max_wait": "10"}, "x: max_wait must be a positive number of seconds"),
        ({"uncertain_hold": 1e300}, "x: uncertain_hold must be a positive number of seconds, at most 3155760000"),
        ({"uncertain_hold": float("inf")}, "x: uncertain_hold must be a positive number of seconds"),
        ({"rate": -1.0}, r"x: rate must be a number of starts per second \(or like '100/m'\), at least 1e-06"),
        ({"rate": 1e300}, "x: rate must be a number of starts per second .* at most 1000000000,"),
        ({"rate": 1e-300}, "x: rate must be a number of starts per second"),
        ({"rate": "1e300/s"}, "x: rate must be a number of starts per second"),
        ({"rate": float("nan")}, "x: rate must be a number of starts per second"),
        ({"rate": 1.0, "burst": 1e12}, "x: burst must be a number of tokens, at least 1 and at most 2147483647"),
        ({"rate": 1.0, "burst": float("inf")}, "x: burst must be a number of tokens"),
    ],
)
def test_numbers_past_what_the_ledger_can_hold_fail_at_configuration_naming_the_option(
    options: dict[str, object], message: str
) -> None:
    """Issue 9: every numeric option is checked against its column type and the clock (ledger/bounds.py), at
    configuration time, naming the name and the option; before, max_wait=1e300 was accepted and the worker died
    on the first waiting task (timestamp overflow), and limit=10**12 failed in Postgres without naming it."""
    with pytest.raises(InvalidConfig, match=message):
        parse_limits({"x": {"limit": 1, **options}})


def test_the_largest_values_the_ledger_can_hold_are_accepted() -> None:
    config = NameConfig(
        "x", limit=2**30 - 1, max_waiting=2**31 - 1, max_wait=3155760000, uncertain_hold=3155760000.0,
        rate="1000000000/s", burst=2**31 - 1,
    )  # fmt: skip
    assert config.rate == 1e9
    assert NameConfig("x", rate="1/h").rate == pytest.approx(1 / 3600)


def test_windows_take_pairs_and_texts_shortest_first() -> None:
    config = NameConfig("q", windows=["10000/d", (100, 60), "5/10s", "3/1.5h"])
    assert config.windows == ((5, 10.0), (100, 60.0), (3, 5400.0), (10000, 86400.0))
    assert NameConfig("q", windows=[]).windows is None
    assert NameConfig.from_setting("q", {"limit": 2, "windows": ["1/m"]}).windows == ((1, 60.0),)


@pytest.mark.parametrize(
    "windows, message",
    [
        ("100/m", "must be a list"),
        (["100/fortnight"], "a window is 'N/unit'"),
        (["0/m"], "a whole number"),
        ([(0, 60)], "at least 1"),
        ([(1.5, 60)], "must be an integer"),
        ([(10, -1)], "positive number of seconds"),
        ([(10, 60), (20, 60)], "same length"),
        ([(1, 60)] * 9, "at most 8"),
        ([(2_000_000, 60)], "at most 1000000"),
    ],
)
def test_bad_windows_are_refused_with_a_clear_error(windows, message) -> None:
    with pytest.raises(InvalidConfig, match=message):
        NameConfig("q", windows=windows)
