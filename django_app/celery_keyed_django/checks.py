"""System checks: a project whose ledger database is not PostgreSQL fails ``manage.py check`` (and so ``migrate``,
``runserver``, every management command that runs checks) before anything touches the database, with a message
that says what to change, instead of a ``RuntimeError`` in the middle of ``migrate``."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, register

from celery_keyed_django.ledger import database_alias


@register()
def ledger_database_is_postgresql(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    alias = database_alias()
    databases = settings.DATABASES
    if alias not in databases:
        return [Error(
            f"celery-keyed's ledger database {alias!r} is not in DATABASES",
            hint="Set CELERY_KEYED_DATABASE to the alias of a PostgreSQL database in DATABASES (default: 'default').",
            id="celery_keyed_django.E001",
        )]
    engine = str(databases[alias].get("ENGINE", ""))
    if "postgresql" not in engine and "postgis" not in engine:
        return [Error(
            f"celery-keyed's ledger needs PostgreSQL, but DATABASES[{alias!r}] uses {engine or 'no ENGINE'}",
            hint="Point DATABASES[" + repr(alias) + "] at PostgreSQL (ENGINE 'django.db.backends.postgresql'), or "
            "keep the project's database and put the ledger in another one: add a PostgreSQL database to "
            "DATABASES, name it in CELERY_KEYED_DATABASE and add 'celery_keyed_django.routers.LedgerRouter' to "
            "DATABASE_ROUTERS.",
            id="celery_keyed_django.E002",
        )]
    return []
