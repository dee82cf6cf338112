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
