"""History: task outcomes (the books: every keyed task that arrived and what became of it; the explain page hangs
off it), the audit trails of limit overrides and of fair weight overrides, and the ledger's events (drift repaired,
forced releases, reclaimed leases, duplicates)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.contrib import admin
from django.db.models import Exists, OuterRef, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.utils.html import format_html

from celery_keyed_django.admin.base import ReadOnlyAdmin, configured_names
from celery_keyed_django.admin.explain import ExplainPage
from celery_keyed_django.admin.rendering import _limit_text, _url, age, explain_link, moment, moment_column, since
from celery_keyed_django.models import OUTCOMES, Claim, Event, FairWeightLog, OverrideLog, TaskRecord, Waiting


class OutcomeFilter(admin.SimpleListFilter):
    title = "outcome"
    parameter_name = "outcome"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("open", "in progress (waiting or running)"), *OUTCOMES]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "open":
            return queryset.filter(outcome__isnull=True)
        return queryset.filter(outcome=self.value()) if self.value() else queryset


class FinishedWithinFilter(admin.SimpleListFilter):
    title = "finished"
    parameter_name = "finished"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("1h", "in the last hour"), ("24h", "in the last 24 hours"), ("7d", "in the last 7 days")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        spans = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}
        if self.value() in spans:
            return queryset.filter(finished_at__gte=timezone.now() - spans[self.value()])
        return queryset


@admin.register(TaskRecord)
class TaskRecordAdmin(ExplainPage, ReadOnlyAdmin):
    list_display = ("task_link", "task_name", "keys_display", "group_key", "outcome_display", "arrived_display",
                    "took_display", "attempts_display", "detail")
    list_display_links = None
    list_filter = (OutcomeFilter, FinishedWithinFilter)
    search_fields = ("=task_id", "=key", "=group_key", "=task_name")
    ordering = ("-arrived_at",)
    list_title = "Outcome history"
    page_help = (
        "The books: every keyed task that arrived and what became of it. A task that never ran (rejected, "
        "expired, superseded, revoked while waiting, dead-lettered) has its result stored as a failure with that "
        "reason."
    )
    empty_state = "No keyed task has arrived yet."

    def get_queryset(self, request: HttpRequest) -> QuerySet[TaskRecord]:
        """Each open task's claim state and whether it is parked: one indexed lookup per shown row each."""
        return super().get_queryset(request).annotate(
            claim_state=Subquery(Claim.objects.filter(task_id=OuterRef("task_id")).values("state")[:1]),
            parked=Exists(Waiting.objects.filter(task_id=OuterRef("task_id"), shadow=False)),
        )

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        context = {"explain_url": _url("explain"), **(extra_context or {})}
        return super().changelist_view(request, extra_context=context)

    @admin.display(description="Task", ordering="task_id")
    def task_link(self, obj: TaskRecord) -> str:
        return explain_link(obj.task_id)

    @admin.display(description="Outcome", ordering="outcome")
    def outcome_display(self, obj: TaskRecord) -> str:
        if obj.outcome is None:  # running (or starting, or over with its slot held), waiting, or between attempts
            words = {"running": "running", "promoted": "starting (given a slot)",
                     "uncertain": "over, slot held"}.get(obj.claim_state or "")
            return format_html("<em>{}</em>", words or ("waiting" if obj.parked else "in progress"))
        colour = "#2a7d2a" if obj.outcome == "completed" else "#ba2121"
        return format_html('<span style="color:{}">{}</span>', colour, obj.get_outcome_display())

    @admin.display(description="Keys", ordering="key")
    def keys_display(self, obj: TaskRecord) -> str:
        """Every key of the task (a task of several keys holds a slot of each), as it arrived."""
        keys = [k for k in (obj.key, *(obj.extra_keys or [])) if k is not None]
        return ", ".join(keys) if keys else "—"

    @admin.display(description="Arrived", ordering="arrived_at")
    def arrived_display(self, obj: TaskRecord) -> str:
        return format_html('<span title="{}">{} ago</span>', moment(obj.arrived_at), since(obj.arrived_at))

    @admin.display(description="Arrival to finish (wait + run)", ordering="finished_at")
    def took_display(self, obj: TaskRecord) -> str:
        if obj.finished_at is None:
            return "—"
        return age(obj.finished_at - obj.arrived_at)

    @admin.display(description="Attempts")
    def attempts_display(self, obj: TaskRecord) -> str:
        return str(obj.finished_attempt + 1) if obj.finished_attempt >= 0 else "—"


@admin.register(OverrideLog)
class OverrideLogAdmin(ReadOnlyAdmin):
    list_display = ("when_display", "name", "action", "change_display", "reason", "author_display", "expiry_display")
    list_display_links = None
    list_filter = ("action",)
    search_fields = ("=name", "author", "reason")
    ordering = ("-at", "-id")
    list_title = "Override audit trail"
    page_help = "Every override set, cleared or lapsed: who, when, old → new limit, and why."
    empty_state = "No override was ever set."

    @admin.display(description="When", ordering="at")
    def when_display(self, obj: OverrideLog) -> str:
        return format_html('<span title="{} ago">{}</span>', since(obj.at), moment(obj.at))

    @admin.display(description="Expiry")
    def expiry_display(self, obj: OverrideLog) -> str:
        return "—" if obj.expires_at is None else moment(obj.expires_at)

    @admin.display(description="Old → new")
    def change_display(self, obj: OverrideLog) -> str:
        known = obj.name in self._configured
        return f"{_limit_text(obj.old_limit, configured=known)} → {_limit_text(obj.new_limit, configured=known)}"

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        self._configured = configured_names()  # once per page (a small table and the settings)
        return super().changelist_view(request, extra_context)

    @admin.display(description="Who", ordering="author")
    def author_display(self, obj: OverrideLog) -> str:
        return obj.author or ("the sweep" if obj.action == "expire" else "—")



def _weight_text(weight: float | None) -> str:
    return "—" if weight is None else f"{weight:g}"


@admin.register(FairWeightLog)
class FairWeightLogAdmin(ReadOnlyAdmin):
    list_display = ("when_display", "name", "prefix", "action", "change_display", "reason", "author_display")
    list_display_links = None
    list_filter = ("action",)
    search_fields = ("=name", "prefix", "author", "reason")
    ordering = ("-at", "-id")
    list_title = "Fair weight audit trail"
    page_help = "Every fair weight override set, cleared or lapsed: who, when, old → new weight, and why."
    empty_state = "No fair weight override was ever set."

    @admin.display(description="When", ordering="at")
    def when_display(self, obj: FairWeightLog) -> str:
        return moment(obj.at)

    @admin.display(description="Old → new")
    def change_display(self, obj: FairWeightLog) -> str:
        return f"{_weight_text(obj.old_weight)} → {_weight_text(obj.new_weight)}"

    @admin.display(description="Who", ordering="author")
    def author_display(self, obj: FairWeightLog) -> str:
        return obj.author or ("the sweep" if obj.action == "expire" else "—")


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = (moment_column("at", "At"), "kind_display", "key", "task_display", "detail")
    list_filter = ("kind",)
    search_fields = ("=task_id", "=key")
    ordering = ("-at", "-id")
    list_title = "Ledger events"
    page_help = (
        "What the ledger wants operators to know: counters repaired by reconcile (drift — a bug, please "
        "report it), forced releases of live holders (recorded breaches of a limit), reclaimed leases, duplicates."
    )
    empty_state = "No events: no drift, no forced release, no reclaimed lease."

    @admin.display(description="Kind", ordering="kind")
    def kind_display(self, obj: Event) -> str:
        if obj.kind in ("forced_release", "drift"):
            return format_html('<strong style="color:#ba2121">{}</strong>', obj.kind.replace("_", " "))
        return obj.kind.replace("_", " ")

    @admin.display(description="Task")
    def task_display(self, obj: Event) -> str:
        return "—" if obj.task_id is None else explain_link(obj.task_id)


