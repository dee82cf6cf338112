"""Settings: ``keyed_queues`` parsing (the other settings are exercised through the gate's tests)."""

from __future__ import annotations

import pytest

from celery_keyed.ledger.errors import InvalidConfig
from celery_keyed.settings import read_settings

URL = "postgresql://user@localhost/db"


def test_keyed_queues_default_is_empty() -> None:
    assert read_settings({"keyed_database_url": URL}).queues == ()


@pytest.mark.parametrize("value", [["keyed", "stripe"], ("keyed", "stripe"), "keyed, stripe", "keyed,stripe,"])
def test_keyed_queues_accepts_a_list_or_a_comma_separated_string(value: object) -> None:
    assert read_settings({"keyed_database_url": URL, "keyed_queues": value}).queues == ("keyed", "stripe")


@pytest.mark.parametrize("value", [[1], [""], 3, {"a": 1}])
def test_keyed_queues_rejects_anything_else(value: object) -> None:
    with pytest.raises(InvalidConfig, match="keyed_queues"):
        read_settings({"keyed_database_url": URL, "keyed_queues": value})


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("keyed_lease", 1e300, "keyed_lease must be a positive number of seconds, at most 3155760000"),
        ("keyed_lease", float("inf"), "keyed_lease must be a positive number of seconds"),
        ("keyed_lease", float("nan"), "keyed_lease must be a positive number of seconds"),
        ("keyed_sweep_interval", 1e300, "keyed_sweep_interval must be a positive number of seconds"),
        ("keyed_dispatch_timeout", 1e300, "keyed_dispatch_timeout must be"),
        ("keyed_reconcile_schedule", float("inf"), "keyed_reconcile_schedule must be"),
        ("keyed_idle_key_ttl", 1e300, "keyed_idle_key_ttl must be"),
        ("keyed_group_arrival_timeout", 1e300, "keyed_group_arrival_timeout must be"),
        ("keyed_reserve_timeout", 1e300, "keyed_reserve_timeout must be"),
        ("keyed_probe_interval", 1e300, "keyed_probe_interval must be"),
        ("keyed_metrics_timeout", 1e300, "keyed_metrics_timeout must be"),
        ("keyed_connect_timeout", 1e10, "keyed_connect_timeout must be a positive number of seconds, at most 21474"),
        ("keyed_statement_timeout", 1e300, "keyed_statement_timeout must be .* at most 2147483.647"),
        ("keyed_statement_timeout", 0.0001, "keyed_statement_timeout must be at least 0.001"),
        ("keyed_pool_size", 2.5, "keyed_pool_size must be an integer"),
        ("keyed_pool_size", 10**6, "keyed_pool_size must be at least 1 and at most 1000"),
        ("keyed_heartbeat_interval", float("nan"), "keyed_heartbeat_interval must be"),
        ("keyed_self_fence_margin", 1e300, "keyed_self_fence_margin must be"),
        ("keyed_concurrency_limits", {"acct": {"max_wait": 1e300}}, "acct: max_wait must be"),
        ("keyed_concurrency_limits", {"acct": 10**12}, "acct: limit must be at least 0 and at most 1073741823"),
    ],
)
def test_numeric_settings_are_bounded_by_what_timestamps_timers_and_postgres_hold(
    setting: str, value: object, message: str
) -> None:
    with pytest.raises(InvalidConfig, match=message):
        read_settings({"keyed_database_url": URL, setting: value})


def test_whole_float_pool_size_is_taken() -> None:
    assert read_settings({"keyed_database_url": URL, "keyed_pool_size": 3.0}).pool_size == 3


@pytest.mark.parametrize(
    ("value", "seconds"), [(True, 0.05), (False, 0.0), (0, 0.0), (0.2, 0.2), (1, 1.0), (60, 60.0)]
)
def test_claim_ahead_is_a_flag_or_the_most_seconds_a_request_may_be_expected_to_wait(
    value: object, seconds: float
) -> None:
    assert read_settings({"keyed_database_url": URL, "keyed_claim_ahead": value}).claim_ahead == seconds


@pytest.mark.parametrize("value", ["yes", -1, 61, float("nan"), float("inf"), [0.1]])
def test_claim_ahead_rejects_anything_else(value: object) -> None:
    with pytest.raises(InvalidConfig, match="keyed_claim_ahead must be True, False or a number of seconds"):
        read_settings({"keyed_database_url": URL, "keyed_claim_ahead": value})


def test_a_group_failure_policy_is_read_from_the_limits_and_checked() -> None:
    limits = {"order": {"group_failure": "skip"}}
    settings = read_settings({"keyed_database_url": URL, "keyed_concurrency_limits": limits})
    assert settings.limits["order"].group_failure == "skip"
    assert settings.limits["order"].limit == 1  # a group name's entry leaves its keys' limit alone
    with pytest.raises(InvalidConfig, match="order: group_failure must be 'halt', 'skip' or 'hold', got 'pause'"):
        read_settings({"keyed_database_url": URL, "keyed_concurrency_limits": {"order": {"group_failure": "pause"}}})
