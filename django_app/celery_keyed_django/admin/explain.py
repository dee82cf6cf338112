"""The explain page: why a task is (not) running, in words — its state, the facts behind it (its key, the limit,
who is ahead of it, its lease...) and, for a waiting task, who holds the slots it waits for. Served by the task
outcomes' page (``ExplainPage``), linked from every task id the admin shows."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone

from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.base import _task_name
from celery_keyed_django.admin.rendering import APP, age, explain_link, moment, since
from celery_keyed_django.forms import ExplainForm
from celery_keyed_django.models import Claim


class ExplainPage(admin.ModelAdmin if TYPE_CHECKING else object):  # type: ignore[misc]  # a ModelAdmin's mixin
    """Mixin for a ``ModelAdmin``: serves the explain page at ``explain/`` under its own pages (URL name
    ``celery_keyed_django_explain``), to whoever may view that model."""

    admin_site: admin.AdminSite
    model: Any

    def get_urls(self) -> list[Any]:
        return [
            path("explain/", self.admin_site.admin_view(self.explain_view), name=f"{APP}_explain"),
            *super().get_urls(),
        ]

    def explain_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        form = ExplainForm(request.GET or None)
        explanation = None
        if form.is_valid():
            explanation = ledger_access.get_ledger().explain(form.cleaned_data["task_id"].strip())
        facts = explanation.facts or {} if explanation else {}
        context = {
            **self.admin_site.each_context(request),
            "title": "Explain a task",
            "opts": self.model._meta,
            "form": form,
            "explanation": explanation,
            "state": STATE_WORDS.get(explanation.state, explanation.state) if explanation else "",
            "facts": fact_rows(facts),
            "holders": slot_holders(facts.get("key"), exclude=explanation.task_id) if explanation
            and explanation.state in {"waiting", "paused"} else [],
        }
        return TemplateResponse(request, f"admin/{APP}/explain.html", context)



#: The explain page's states, in words.
STATE_WORDS = {
    "unknown": "unknown to the ledger",
    "registered": "registered in its group, not received yet",
    "running": "running",
    "promoted": "given a slot, being dispatched",
    "waiting": "waiting for a slot",
    "paused": "waiting: its name is paused",
    "blocked": "waiting for its group",
    "not_before": "waiting: not due yet",
    "shadow": "a duplicate delivery",
    "between_attempts": "between attempts",
    "uncertain": "over, slot held (uncertain hold)",
    "finished": "finished",
}

#: The explain page's facts, in words (key → label); facts not listed get their name with spaces.
FACT_LABELS = {
    "attempt": "Attempt",
    "key": "Key",
    "keys": "All its keys",
    "cost": "Slots it takes of each key",
    "group_key": "Group",
    "group_seq": "Number in its group",
    "seq": "Number in its group",
    "shadow": "Duplicate delivery (kept in case its running attempt is lost)",
    "group_blocked": "Waiting for its group's head",
    "deadline": "Latest start",
    "priority": "Priority",
    "not_before": "Not before",
    "not_due": "Not due yet",
    "ahead": "Tasks waiting ahead of it",
    "in_flight": "Tasks in flight under the key",
    "k": "Limit of the key (slots)",
    "blocked_by": "Group head it waits for",
    "shard": "Counter shard",
    "state": "Claim state",
    "fence": "Fence (grows on every claim of the slot)",
    "holder": "Worker holding it",
    "dispatch_deadline": "Must be picked up by",
    "lease_left": "Lease left",
    "extra_keys": "Its other keys",
    "held_outcome": "Outcome of the attempt",
    "received": "Received by a worker",
    "task_name": "Task name",
    "arrived_at": "Arrived",
    "outcome": "Outcome",
    "finished_attempt": "Finished attempt",
    "finished_at": "Finished",
    "detail": "Detail",
    "duplicates": "Duplicate deliveries seen",
    "notified": "Result stored",
}


def fact_value(name: str, value: Any) -> Any:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        return moment(value)
    if name == "lease_left" and value is not None:
        seconds = float(value)
        if seconds < 0:
            return f"lapsed {age(timedelta(seconds=-seconds))} ago"
        return age(timedelta(seconds=seconds))
    if name == "k" and value == 0:
        return "0 (paused)"
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value) or None
    if name == "finished_attempt" and value == -1:
        return None
    return value


def fact_rows(facts: dict[str, Any]) -> list[tuple[str, Any]]:
    """The facts behind an explanation as (label, value) rows, known facts first in a reading order."""
    order = list(FACT_LABELS)
    names = sorted(facts, key=lambda n: (order.index(n) if n in order else len(order), n))
    return [(FACT_LABELS.get(n, n.replace("_", " ").capitalize()), fact_value(n, facts[n])) for n in names]


def slot_holders(key: str | None, *, exclude: str) -> list[dict[str, Any]]:
    """Who holds the slots of ``key`` now: each claim's task (with its name from the books), worker, time held and
    lease left — what a waiting task waits for."""
    if not key:
        return []
    claims = (Claim.objects.filter(Q(key=key) | Q(extra_keys__contains=[key])).exclude(task_id=exclude)
              .annotate(task_name=_task_name()).order_by("claimed_at")[:20])
    now = timezone.now()
    return [
        {
            "task_id": claim.task_id,
            "link": explain_link(claim.task_id),
            "task_name": getattr(claim, "task_name", None) or "—",
            "state": {"running": "running", "promoted": "given the slot, being dispatched",
                      "uncertain": "over, slot held (uncertain hold)"}.get(claim.state, claim.state),
            "holder": claim.holder or "—",
            "held": since(claim.claimed_at),
            "lease": fact_value("lease_left", (claim.lease_expires_at - now).total_seconds()),
        }
        for claim in claims
    ]

