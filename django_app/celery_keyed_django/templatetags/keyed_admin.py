"""Template tags of the admin's overview (the app's landing page): ``{% keyed_overview %}`` renders the names'
table, ``{% keyed_groups app_list app_label as groups %}`` splits the app's pages into groups (``admin/overview.py``).
"""

from __future__ import annotations

from typing import Any

from django import template

from celery_keyed_django.admin.overview import Overview, grouped, overview

register = template.Library()


@register.inclusion_tag("admin/celery_keyed_django/overview.html")
def keyed_overview() -> dict[str, Overview]:
    return {"overview": overview()}


@register.simple_tag
def keyed_groups(app_list: list[dict[str, Any]], app_label: str) -> list[dict[str, Any]]:
    return grouped(app_list, app_label)
