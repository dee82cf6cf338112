"""The settings of issue 14 items 3 and 7: keyed_config_version (an integer >= 0, default 0) and
keyed_send_arrival_timeout (seconds, default an hour)."""

from __future__ import annotations

import pytest

from celery_keyed.ledger import InvalidConfig
from celery_keyed.settings import read_settings

URL = "postgresql+psycopg://u@h/db"


def test_defaults() -> None:
    settings = read_settings({"keyed_database_url": URL})
    assert (settings.config_version, settings.send_arrival_timeout) == (0, 3600.0)


def test_values() -> None:
    settings = read_settings({"keyed_database_url": URL, "keyed_config_version": 7, "keyed_send_arrival_timeout": 60})
    assert (settings.config_version, settings.send_arrival_timeout) == (7, 60.0)


@pytest.mark.parametrize("value", [-1, 1.5, "2", True, 2**31])
def test_config_version_must_be_a_nonnegative_int(value: object) -> None:
    with pytest.raises(InvalidConfig, match="keyed_config_version"):
        read_settings({"keyed_database_url": URL, "keyed_config_version": value})


@pytest.mark.parametrize("value", [0, -5, float("nan"), "soon"])
def test_send_arrival_timeout_must_be_seconds(value: object) -> None:
    with pytest.raises(InvalidConfig, match="keyed_send_arrival_timeout"):
        read_settings({"keyed_database_url": URL, "keyed_send_arrival_timeout": value})
