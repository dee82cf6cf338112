"""Claims, the held slots: one row per running attempt (or one promoted and being dispatched) with what it holds,
its worker, how long it has held the slot and the lease it has left; and the forced release of selected claims
(fenced: a claim that changed meanwhile is left alone; a live holder's is a recorded breach of the limit), which
needs its own permission and a reason, goes through the ledger and dispatches the promotions it made."""

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

from celery_keyed.ledger import EXCLUSIVE_COST, Token
from celery_keyed.ledger.admin_queries import force_release
from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.base import ReadOnlyAdmin, _task_name
from celery_keyed_django.admin.rendering import (
    APP,
    _promotions_text,
    age,
    log_action,
    since,
    task_cell,
)
from celery_keyed_django.forms import ReasonForm
from celery_keyed_django.models import Claim


@admin.register(Claim)
class ClaimAdmin(ReadOnlyAdmin):
    list_display = ("task_link", "holds_display", "state_display", "holder_display", "held_display")
    list_display_links = None
    list_filter = ("state",)
    search_fields = ("=task_id", "=key", "=group_key", "holder")
    ordering = ("claimed_at",)
    actions = ("force_release_action",)
    list_title = "Claims (held slots)"
    page_help = (
        "Held slots: one row per running attempt (or one promoted and being dispatched). A worker renews its "
        "leases; a lease that lapses is reclaimed by the reaper. Force release frees a slot now — if its worker "
        "is still alive, that is a recorded breach of the limit."
    )
    empty_state = "No claims: no keyed task is running right now."
    auto_refresh = True

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{APP}.force_release")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Claim]:
        return super().get_queryset(request).annotate(task_name=_task_name())

    @admin.display(description="Task", ordering="task_id")
    def task_link(self, obj: Claim) -> str:
        """Its id, name and attempt, and its arguments (from the stored message of an attempt that waited: a claim
        taken at once keeps none)."""
        return task_cell(obj.task_id, getattr(obj, "task_name", None), obj.parked, obj.attempt)

    @admin.display(description="Holder", ordering="holder")
    def holder_display(self, obj: Claim) -> str:
        """The worker process that holds it (host:pid:…), shortened; the whole of it in the tooltip."""
        holder = obj.holder or "—"
        short = holder if len(holder) <= 32 else holder[:31] + "…"
        return format_html('<span title="{}">{}</span>', holder, short)

    @admin.display(description="Holds", ordering="key")
    def holds_display(self, obj: Claim) -> str:
        """The slot this claim holds: key and shard, further keys, its group."""
        parts = []
        if obj.key is not None:
            parts.append(obj.key if not obj.shard else f"{obj.key} (shard {obj.shard})")
        parts += obj.extra_keys or []
        if obj.group_key is not None:
            parts.append(f"group {obj.group_key}")
        cost = f" ({obj.cost} slots of each)" if obj.cost and obj.cost > 1 else ""
        if obj.cost and obj.cost >= EXCLUSIVE_COST:
            cost = " (exclusive: alone on its key)"  # readers and writers
        return ", ".join(parts) + cost if parts else "—"

    @admin.display(description="State", ordering="state")
    def state_display(self, obj: Claim) -> str:
        """Its state, and a cancel a newer arrival asked for (newest wins): its worker ends it as superseded."""
        if obj.cancel_requested_at is None:
            return format_html('<span title="fence {}">{}</span>', obj.fence, obj.state)
        return format_html(
            '<span title="fence {}">{}</span> <span style="color:#ba2121">— cancel requested {} ago ({})</span>',
            obj.fence, obj.state, age(timezone.now() - obj.cancel_requested_at), obj.cancel_detail or "",
        )

    @admin.display(description="Held, lease left", ordering="claimed_at")
    def held_display(self, obj: Claim) -> str:
        """How long it has held its slot, and how long its lease has left (red once lapsed: the reaper frees it)."""
        left = obj.lease_expires_at - timezone.now()
        if left.total_seconds() < 0:
            return format_html('{}, <span style="color:#ba2121">lease lapsed {} ago</span>', since(obj.claimed_at),
                               age(-left))
        return format_html("{}, {} left", since(obj.claimed_at), age(left))

    @admin.action(description="Force release the selected claims…", permissions=["force_release"])
    def force_release_action(self, request: HttpRequest, queryset: QuerySet[Claim]) -> HttpResponse | None:
        claims = list(queryset.order_by("claimed_at"))
        form = ReasonForm(request.POST if request.POST.get("post") == "yes" else None)
        if request.POST.get("post") == "yes" and form.is_valid():
            self._force_release(request, claims, form.cleaned_data["reason"])
            return None
        now = timezone.now()
        rows = [{"claim": c, "alive": c.lease_expires_at > now, "lease": age(c.lease_expires_at - now)} for c in claims]
        context = {
            **self.admin_site.each_context(request),
            "title": "Force release claims?",
            "opts": self.model._meta,
            "rows": rows,
            "breaches": sum(1 for r in rows if r["alive"] and r["claim"].state == "running"),
            "form": form,
            "action": "force_release_action",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, f"admin/{APP}/claim/force_release.html", context)

    def _force_release(self, request: HttpRequest, claims: list[Claim], reason: str) -> None:
        ledger = ledger_access.get_ledger()
        author = request.user.get_username()
        released = breaches = stale = 0
        promotions: list[Any] = []
        for claim in claims:
            token, fence = Token(claim.task_id, claim.attempt), claim.fence

            def work(conn: Any, token: Token = token, fence: int = fence) -> Any:
                return force_release(conn, token, fence, reason=reason, author=author, dispatch=ledger.dispatch)

            result = ledger.transaction(work)
            if result.released:
                released += 1
                breaches += result.breach
                promotions += result.promotions
            else:
                stale += 1
        stale += 0 if claims else 1
        started = ledger_access.dispatch(promotions)
        if released:
            messages.success(request, f"Released {released} claim{'s' if released != 1 else ''}.")
            log_action(request, claims, CHANGE, f"Force-released: {reason}")
        if breaches:
            messages.warning(request, f"{breaches} of them had a live worker: recorded as a breach of the limit "
                                      "(ledger event “forced_release”); that task is booked revoked.")
        if stale:
            messages.info(request, f"{stale} claim{'s' if stale != 1 else ''} had changed meanwhile (released or "
                                   "claimed again with a new fence): left alone.")
        if promotions:
            messages.info(request, _promotions_text(promotions, started))

