"""The plumbing between the senders, the broker and the workers: the worker processes (and the configuration version
each started with), the sends accepted at send (and those refused), and the outbox of messages registered at publish
that no worker has received yet."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Count, Exists, Max, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.utils.html import format_html

from celery_keyed_django.admin.base import ReadOnlyAdmin
from celery_keyed_django.admin.rendering import explain_link, moment_column
from celery_keyed_django.models import Claim, Holder, Name, Outbox, SendRefusals, Sent


@admin.register(Holder)
class HolderAdmin(ReadOnlyAdmin):
    list_display = ("hostname", "pid", moment_column("started_at", "Started at"),
                    "latest_display", "config_version_display", "claims_display")
    search_fields = ("hostname", "=holder")
    ordering = ("-started_at",)
    list_title = "Workers"
    page_help = (
        "Every worker process start (a restart is a new row) and the keyed_config_version it started with. "
        "A worker running an older version than the one stored never overwrites the stored limits: it runs with "
        "the newer ones the ledger holds."
    )
    empty_state = "No worker has started against this ledger yet."

    def get_queryset(self, request: HttpRequest) -> QuerySet[Holder]:
        newer = Holder.objects.filter(hostname=OuterRef("hostname"), started_at__gt=OuterRef("started_at"))
        claims = Claim.objects.filter(holder=OuterRef("holder")).order_by().values("holder")
        return super().get_queryset(request).annotate(
            superseded=Exists(newer),
            claims=Coalesce(Subquery(claims.annotate(n=Count("*")).values("n")[:1]), 0),
        )

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        newest = Name.objects.aggregate(v=Max("config_version"))["v"] or 0
        self._newest = newest
        help_text = f"{self.page_help} Configuration version stored: {newest}."
        return super().changelist_view(request, extra_context={"page_help": help_text, **(extra_context or {})})

    @admin.display(description="Latest start of its host", boolean=True)
    def latest_display(self, obj: Any) -> bool:
        return not obj.superseded

    @admin.display(description="Configuration version", ordering="config_version")
    def config_version_display(self, obj: Holder) -> str:
        if obj.config_version is None:
            return "—"
        newest = getattr(self, "_newest", 0)
        if obj.config_version < newest:
            return format_html('{} <strong style="color:#ba2121">older than stored {}</strong>', obj.config_version,
                               newest)
        return str(obj.config_version)

    @admin.display(description="Claims held")
    def claims_display(self, obj: Any) -> int:
        return int(obj.claims)


# -- refusal at send -------------------------------------------------------------------------------------------------


@admin.register(Sent)
class SentAdmin(ReadOnlyAdmin):
    list_display = ("task_display", "key", "dedupe_key", moment_column("sent_at", "Sent at"),
                    moment_column("expires_at", "Expires at"))
    search_fields = ("=task_id", "=key", "=dedupe_key")
    ordering = ("-sent_at",)
    list_title = "Accepted sends"
    page_help = (
        "Tasks accepted at send (keyed_admit_at_send): each holds a place in its key's waiting room until it parks "
        "or runs, and its dedupe key until its final outcome. One that never arrives stops counting at its expiry; "
        "reconcile drops the rows that hold nothing any more."
    )
    empty_state = "No accepted sends: no task was sent with keyed_admit_at_send, or reconcile dropped them."

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        refused = ", ".join(
            f"{r.name}: {r.refused} {'room full' if r.reason == 'room_full' else 'duplicate'}"
            for r in SendRefusals.objects.order_by("name", "reason")
        )
        help_text = f"{self.page_help} Refused sends (nothing published, nothing booked): {refused or 'none'}."
        return super().changelist_view(request, extra_context={"page_help": help_text, **(extra_context or {})})

    @admin.display(description="Task", ordering="task_id")
    def task_display(self, obj: Sent) -> str:
        return explain_link(obj.task_id)


# -- the outbox -------------------------------------------------------------------------------------------------------


@admin.register(Outbox)
class OutboxAdmin(ReadOnlyAdmin):
    list_display = ("task_display", "task_name", "key", "group_key", moment_column("registered_at", "Registered at"),
                    "state_display", moment_column("due_at", "Due at"))
    search_fields = ("=task_id", "=key", "=group_key", "=task_name")
    ordering = ("registered_at",)
    list_title = "Outbox: registered, not received"
    page_help = (
        "Keyed messages stored at publish (keyed_register_at_publish) that no worker has received yet. A message "
        "registered in the caller's transaction is published by the relay (each worker's sweep, beat's reconcile) "
        "after that transaction commits; one that no worker received by its due time is published again from this "
        "copy (a late first copy is then dropped as a duplicate). A row goes when its task arrives."
    )
    empty_state = "Nothing in the outbox: every registered message was received (or none was registered)."

    @admin.display(description="Task", ordering="task_id")
    def task_display(self, obj: Outbox) -> str:
        return explain_link(obj.task_id)

    @admin.display(description="State", ordering="republished")
    def state_display(self, obj: Outbox) -> str:
        if obj.pending:
            return "not published yet (waits for its transaction's commit)"
        times = obj.republished
        return f"registered, not received, republished {times} time{'' if times == 1 else 's'}"
