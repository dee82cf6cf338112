"""The ledger's engine: PostgreSQL only, said clearly at once (no database needed)."""

from __future__ import annotations

import pytest

from celery_keyed.engine import create_ledger_engine
from celery_keyed.ledger.errors import InvalidConfig
from celery_keyed.settings import read_settings


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sqlite:///ledger.db", "keyed_database_url must be a PostgreSQL URL .* got a 'sqlite' URL"),
        ("sqlite://", "must be a PostgreSQL URL"),
        ("mysql://user:secret@db/app", r"got a 'mysql' URL \(mysql://user:\*\*\*@db/app\)"),
        ("mysql+pymysql://u@db/app", "got a 'mysql' URL"),
        ("not a url", "keyed_database_url is not a database URL: the ledger needs PostgreSQL"),
        ("postgresql+pg8000://u@db/app", "names a PostgreSQL driver that is not installed"),
    ],
)
def test_a_ledger_url_that_is_not_postgresql_is_a_clear_error(url: str, message: str) -> None:
    """Issue 9: sqlite:// and mysql:// gave ModuleNotFoundError (or worse) instead of saying the ledger must be
    PostgreSQL; the password never shows."""
    settings = read_settings({"keyed_database_url": url})
    with pytest.raises(InvalidConfig, match=message) as caught:
        create_ledger_engine(settings)
    assert "secret" not in str(caught.value)


def test_a_postgresql_url_makes_an_engine_without_connecting() -> None:
    engine = create_ledger_engine(read_settings({"keyed_database_url": "postgresql://u@127.0.0.1:1/db"}))
    try:
        assert engine.url.drivername == "postgresql+psycopg"
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"keyed_connect_args": ["sslmode", "require"]}, "keyed_connect_args must be a table of psycopg.connect"),
        ({"keyed_connect_args": {"": 1}}, "keyed_connect_args must be a table"),
        ({"keyed_pooler": "yes"}, "keyed_pooler must be True or False"),
    ],
)
def test_connect_settings_are_checked(conf: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        read_settings({"keyed_database_url": "postgresql://u@127.0.0.1:1/db", **conf})


def test_a_prepare_threshold_in_the_url_must_be_a_number_or_none() -> None:
    settings = read_settings({"keyed_database_url": "postgresql://u@127.0.0.1:1/db?prepare_threshold=often"})
    with pytest.raises(InvalidConfig, match="prepare_threshold must be a whole number or 'none'"):
        create_ledger_engine(settings)
