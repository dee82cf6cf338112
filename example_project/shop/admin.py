from __future__ import annotations

from django.contrib import admin

from example_project.shop.models import Observation


@admin.register(Observation)
class ObservationAdmin(admin.ModelAdmin):
    """What the tasks recorded themselves (read-only): the demo's independent observer."""

    list_display = ("at", "kind", "label", "key", "attempt", "worker", "pid")
    list_filter = ("kind",)
    search_fields = ("key", "label", "task_id")
    show_full_result_count = False

    def has_add_permission(self, request: object) -> bool:
        return False

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False
