from __future__ import annotations

from django.apps import AppConfig


class ShopConfig(AppConfig):
    name = "example_project.shop"
    label = "shop"
    verbose_name = "Shop (example)"
    default_auto_field = "django.db.models.BigAutoField"
