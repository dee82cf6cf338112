"""pytest-django on the session's throwaway PostgreSQL (never sqlite): settings from tests/django/settings.py,
configured here (not through DJANGO_SETTINGS_MODULE, which would leak into the environment of the acceptance
tests' worker subprocesses and switch on Celery's Django fixup there).

The test database is created by Django's own ``migrate``, i.e. through this app's migrations, which apply the
core's ledger migrations. Ledger writes go through the ledger's own connections (they commit), so each test that
touched the database leaves the ledger tables empty behind it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import django
import pytest
import sqlalchemy as sa
from django.conf import settings
from sqlalchemy.engine import make_url

from tests.django import settings as test_settings

if not settings.configured:
    settings.configure(**{name: getattr(test_settings, name) for name in dir(test_settings) if name.isupper()})
    django.setup()

#: Ledger tables emptied after each test (children before parents is not needed: the ledger has no foreign keys).
LEDGER_TABLES = (
    "keyed_names",
    "keyed_overrides",
    "keyed_override_log",
    "keyed_slots",
    "keyed_keys",
    "keyed_holders",
    "keyed_tasks",
    "keyed_claims",
    "keyed_waiting",
    "keyed_groups",
    "keyed_group_members",
    "keyed_events",
    "keyed_books_pruned",
    "keyed_outbox",
    "keyed_key_overrides",
    "keyed_fair_weight_overrides",
    "keyed_fair_weight_log",
)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(postgres_server: Any) -> None:
    """Point Django's default database at the session's PostgreSQL server before the test database is made."""
    url = make_url(postgres_server.url)
    db = settings.DATABASES["default"]
    db.update(HOST=url.host or "", PORT=str(url.port or ""), USER=url.username or "", PASSWORD=url.password or "")
    db["NAME"] = "keyed_django"


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None) -> Iterator[None]:
    """pytest-django's test database; the ledger's own connections are closed before it is dropped."""
    from celery_keyed_django.ledger import dispose_engines

    yield
    dispose_engines()


@pytest.fixture(autouse=True)
def _empty_ledger_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "django_db_setup" not in request.fixturenames:
        return
    from celery_keyed_django.ledger import ledger_engine

    with ledger_engine().begin() as conn:
        for table in LEDGER_TABLES:
            conn.execute(sa.text(f"DELETE FROM {table}"))


@pytest.fixture
def ledger_engine(db: None) -> sa.Engine:
    """The admin's own engine on the test database (the ledger's connection, not Django's)."""
    from celery_keyed_django.ledger import ledger_engine as engine

    return engine()
