"""Waiting tasks: parked attempts, stored in PostgreSQL and acked at the broker, in arrival order (priority first
within a key), with their state in line; and the cancel (revoke) of selected tasks, which needs its own permission
and a reason, goes through the ledger's revoke and dispatches the promotions it made."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html

from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.base import ReadOnlyAdmin
from celery_keyed_django.admin.rendering import (
    APP,
    _promotions_text,
    age,
    log_action,
    since,
    task_cell,
)
from celery_keyed_django.forms import ReasonForm
from celery_keyed_django.models import Waiting


class WaitingStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("ready", "in line"), ("not_before", "not due yet (retry / ETA / debounce)"),
                ("blocked", "blocked behind its group"), ("shadow", "duplicate (shadow of a running attempt)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "ready":
            return queryset.filter(shadow=False, group_blocked=False, not_before__isnull=True)
        if value == "not_before":
            return queryset.filter(not_before__isnull=False)
        if value == "blocked":
            return queryset.filter(group_blocked=True)
        if value == "shadow":
            return queryset.filter(shadow=True)
        return queryset


@admin.register(Waiting)
class WaitingAdmin(ReadOnlyAdmin):
    list_display = ("task_link", "key_display", "priority", "waited_display", "state_display", "queue")
    list_display_links = None
    list_filter = (WaitingStateFilter,)
    search_fields = ("=task_id", "=key", "=group_key")
    ordering = ("arrival",)
    actions = ("cancel_action",)
    list_title = "Waiting tasks"
    page_help = (
        "Parked tasks, stored in Postgres and acked at the broker, in arrival order (priority first within "
        "a key). Cancel revokes a task through the ledger: it leaves the line and its result is stored as revoked."
    )
    empty_state = "Nobody is waiting: every keyed task that arrived got a slot."
    auto_refresh = True

    def has_cancel_waiting_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{APP}.cancel_waiting")

    @admin.display(description="Task", ordering="task_id")
    def task_link(self, obj: Waiting) -> str:
        return task_cell(obj.task_id, (obj.message or {}).get("task"), obj.message, obj.attempt)

    @admin.display(description="Key (group, number)", ordering="key")
    def key_display(self, obj: Waiting) -> str:
        group = "" if obj.group_key is None else f"{obj.group_key} (#{obj.group_seq})"
        if obj.key is None:
            return group or "—"
        sub = format_html('<br><span class="keyed-sub">{}</span>', group) if group else ""
        return format_html("{}{}", obj.key, sub)

    @admin.display(description="Waiting for", ordering="arrival")
    def waited_display(self, obj: Waiting) -> str:
        return since(obj.arrived_at)

    @admin.display(description="State")
    def state_display(self, obj: Waiting) -> str:
        """Its state, then when it may start (not before) and its latest start (a deadline), in smaller type."""
        notes = []
        now = timezone.now()
        if obj.not_before is not None:
            left = obj.not_before - now
            notes.append(f"not before: in {age(left)}" if left.total_seconds() > 0 else "not before: due")
        if obj.deadline is not None:
            left = obj.deadline - now
            notes.append(f"latest start: in {age(left)}" if left.total_seconds() > 0 else "latest start: passed")
        extra = format_html('<br><span class="keyed-sub">{}</span>', "; ".join(notes)) if notes else ""
        return format_html("{}{}", self._state(obj, now), extra)

    @staticmethod
    def _state(obj: Waiting, now: Any) -> str:
        if obj.shadow:
            return "duplicate"
        if obj.group_blocked:
            return "blocked by group"
        if obj.not_before is not None and obj.debounce_cap is not None and obj.not_before > now:
            return "debounced"  # waits out its key's quiet period (at most until debounce_cap)
        if obj.not_before is not None:
            return "not due"
        return "in line"

    @admin.action(description="Cancel (revoke) the selected tasks…", permissions=["cancel_waiting"])
    def cancel_action(self, request: HttpRequest, queryset: QuerySet[Waiting]) -> HttpResponse | None:
        rows = list(queryset.order_by("arrival"))
        form = ReasonForm(request.POST if request.POST.get("post") == "yes" else None)
        if request.POST.get("post") == "yes" and form.is_valid():
            ledger = ledger_access.get_ledger()
            promotions: list[Any] = []
            task_ids = sorted({r.task_id for r in rows if not r.shadow})
            for task_id in task_ids:
                promotions += ledger.revoke(task_id)
            started = ledger_access.dispatch(promotions)
            messages.success(request, f"Cancelled {len(task_ids)} waiting task{'s' if len(task_ids) != 1 else ''}: "
                                      f"booked revoked ({form.cleaned_data['reason']}).")
            log_action(request, [r for r in rows if not r.shadow], CHANGE,
                       f"Cancelled (revoked): {form.cleaned_data['reason']}")
            if any(r.shadow for r in rows):
                messages.info(request, "Duplicates (shadows) were left alone: they follow their running attempt.")
            if promotions:
                messages.info(request, _promotions_text(promotions, started))
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Cancel waiting tasks?",
            "opts": self.model._meta,
            "rows": rows,
            "form": form,
            "action": "cancel_action",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, f"admin/{APP}/waiting/cancel.html", context)

