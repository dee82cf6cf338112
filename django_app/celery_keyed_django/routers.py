"""A database router for a ledger that is not in Django's ``default`` database.

With ``CELERY_KEYED_DATABASE = "ledger"``, add ``"celery_keyed_django.routers.LedgerRouter"`` to
``DATABASE_ROUTERS``: the app's models are read from that database and its migrations (which apply the core's
schema) run there only.
"""

from __future__ import annotations

from typing import Any

from celery_keyed_django.ledger import database_alias

APP_LABEL = "celery_keyed_django"


class LedgerRouter:
    def db_for_read(self, model: type, **hints: Any) -> str | None:
        return database_alias() if model._meta.app_label == APP_LABEL else None  # type: ignore[attr-defined]

    def db_for_write(self, model: type, **hints: Any) -> str | None:
        return database_alias() if model._meta.app_label == APP_LABEL else None  # type: ignore[attr-defined]

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool | None:
        return None

    def allow_migrate(self, db: str, app_label: str, model_name: str | None = None, **hints: Any) -> bool | None:
        if app_label == APP_LABEL:
            return db == database_alias()
        return None
