"""The Django app of celery-keyed: read-only models over the ledger's tables and an admin for operators."""

from __future__ import annotations

from django.apps import AppConfig


class CeleryKeyedConfig(AppConfig):
    name = "celery_keyed_django"
    label = "celery_keyed_django"
    verbose_name = "Keyed concurrency"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery_keyed_django import checks  # noqa: F401  (registers the system checks)
