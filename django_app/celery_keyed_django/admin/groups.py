"""Held groups: the ordered groups of a name whose ``group_failure`` is ``hold``, held since their head failed, with
the head and why; and the operator's two ways out, each needing its own permission and a reason: resume (the group
goes on as if the failure had not held it: the head's retry runs, or the next number) and skip the head (the failed
head is dead-lettered when it has not ended yet, and the next number starts). Both go through the ledger's guarded
calls (a group no longer held is left alone) and dispatch the promotions they made."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE
from django.db.models import Count, OuterRef, QuerySet, Subquery
from django.db.models.functions import Coalesce
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.base import ReadOnlyAdmin
from celery_keyed_django.admin.rendering import APP, _promotions_text, explain_link, log_action, since
from celery_keyed_django.forms import ReasonForm
from celery_keyed_django.models import GroupMember, HeldGroup

#: What each action does, for its confirmation page and its message.
ACTIONS = {
    "resume_action": ("Resume", "resumed", "The group goes on as if the failure had not held it: the head's retry runs "
                      "(or, when the head ended for good, the next number starts)."),
    "skip_action": ("Skip the failed head of", "skipped its head", "The failed head is dead-lettered (when it has not "
                    "ended yet: its waiting retry leaves the line) and the next number of the group starts."),
}


@admin.register(HeldGroup)
class HeldGroupAdmin(ReadOnlyAdmin):
    list_display = ("group_key", "head_link", "held_display", "held_reason", "members_display")
    list_display_links = None
    search_fields = ("=group_key", "=held_task_id")
    actions = ("resume_action", "skip_action")
    list_title = "Held groups"
    page_help = (
        "Ordered groups held since their head failed (the name's group_failure is 'hold'): nothing of the group "
        "starts until you resume it (the head's retry runs) or skip its head (dead-lettered; the next number starts)."
    )
    empty_state = "No group is held."
    auto_refresh = True

    def get_queryset(self, request: HttpRequest) -> QuerySet[HeldGroup]:
        members = (GroupMember.objects.filter(group_key=OuterRef("group_key")).order_by().values("group_key")
                   .annotate(n=Count("*")).values("n"))
        return super().get_queryset(request).filter(held_since__isnull=False).annotate(
            members=Coalesce(Subquery(members), 0))

    def has_release_groups_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{APP}.release_groups")

    @admin.display(description="Failed head", ordering="held_task_id")
    def head_link(self, obj: HeldGroup) -> str:
        return explain_link(obj.held_task_id or "")

    @admin.display(description="Held for", ordering="held_since")
    def held_display(self, obj: HeldGroup) -> str:
        return since(obj.held_since)

    @admin.display(description="Members left", ordering="members")
    def members_display(self, obj: HeldGroup) -> int:
        return int(getattr(obj, "members", 0) or 0)

    @admin.action(description="Resume the selected groups…", permissions=["release_groups"])
    def resume_action(self, request: HttpRequest, queryset: QuerySet[HeldGroup]) -> HttpResponse | None:
        return self._act(request, queryset, "resume_action")

    @admin.action(description="Skip the failed heads of the selected groups…", permissions=["release_groups"])
    def skip_action(self, request: HttpRequest, queryset: QuerySet[HeldGroup]) -> HttpResponse | None:
        return self._act(request, queryset, "skip_action")

    def _act(self, request: HttpRequest, queryset: QuerySet[HeldGroup], action: str) -> HttpResponse | None:
        rows = list(queryset.order_by("held_since", "group_key"))
        verb, done, explanation = ACTIONS[action]
        form = ReasonForm(request.POST if request.POST.get("post") == "yes" else None)
        if request.POST.get("post") == "yes" and form.is_valid():
            reason = form.cleaned_data["reason"]
            author = request.user.get_username()
            ledger = ledger_access.get_ledger()
            call = ledger.resume_group if action == "resume_action" else ledger.skip_group_head
            promotions: list[Any] = []
            acted: list[HeldGroup] = []
            for row in rows:
                result = call(row.group_key, reason=reason, author=author)
                if result is not None:  # None: no longer held (another operator, or a race): left alone
                    acted.append(row)
                    promotions += result.promotions
            started = ledger_access.dispatch(promotions)
            messages.success(request, f"{verb.split(' ')[0]}: {done} for {len(acted)} group"
                                      f"{'s' if len(acted) != 1 else ''} ({reason}).")
            if len(acted) < len(rows):
                messages.info(request, f"{len(rows) - len(acted)} of the selected groups were no longer held: "
                                       "left alone.")
            log_action(request, acted, CHANGE, f"{verb} held group: {reason}")
            if promotions:
                messages.info(request, _promotions_text(promotions, started))
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": f"{verb} held groups?",
            "opts": self.model._meta,
            "rows": rows,
            "form": form,
            "action": action,
            "explanation": explanation,
            "verb": verb,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, f"admin/{APP}/heldgroup/confirm.html", context)
