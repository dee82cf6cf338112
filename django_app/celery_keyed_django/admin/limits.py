"""Limits of names: the runtime overrides (set, change, clear, each with its audit trail) and the configured names
with their effective limit. Writes go through the ledger (``set_override`` / ``clear_override``: the row, its
audit entry and the promotions in one transaction); the promotions are then dispatched."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.models import ADDITION, CHANGE, DELETION
from django.core.exceptions import PermissionDenied
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from celery_keyed.ledger import rate_text, window_text
from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.base import (
    ReadOnlyAdmin,
    _limit_and_source,
    _limits,
    _override_link,
    configured_names,
)
from celery_keyed_django.admin.rendering import (
    APP,
    CHANGE_LIMITS,
    UNCONFIGURED,
    _limit_text,
    _promotions_text,
    _url,
    age,
    log_action,
    moment,
    moment_column,
    since,
)
from celery_keyed_django.bad_input import RefusesBadInput
from celery_keyed_django.forms import OverrideForm, ReasonForm
from celery_keyed_django.models import Key, Name, Override, OverrideLog


@admin.register(Override)
class OverrideAdmin(RefusesBadInput, admin.ModelAdmin):
    """Runtime limits per name. Writes go through ``set_override`` / ``clear_override`` (audit trail, promotions)."""

    form = OverrideForm
    change_list_template = f"admin/{APP}/change_list.html"
    list_display = ("name", "limit_display", "configured_display", "reason", "author",
                    moment_column("set_at", "Set at"), "expiry_display",
                    "clear_link")
    list_display_links = ("name",)
    search_fields = ("name", "reason", "author")
    ordering = ("name",)
    list_per_page = 100
    show_full_result_count = False
    readonly_fields = ("audit_trail",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Override]:
        return super().get_queryset(request).annotate(
            configured_limit=Subquery(Name.objects.filter(name=OuterRef("name")).values("slot_limit")[:1])
        )

    # permissions: viewing needs view_override (or change_limits); every write needs change_limits.
    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) or request.user.has_perm(CHANGE_LIMITS)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(CHANGE_LIMITS)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm(CHANGE_LIMITS)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # clearing is its own page: it needs a reason, and goes through clear_override

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        return {}

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("name", "audit_trail") if obj is not None else ()

    def get_list_display(self, request: HttpRequest) -> Any:
        """No "Clear…" button for whoever may only look (it would lead to a 403)."""
        shown = super().get_list_display(request)
        return shown if self.has_change_permission(request) else [c for c in shown if c != "clear_link"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = ["name", "slot_limit", "reason", "expires_at"]
        return [*fields, "audit_trail"] if obj is not None else fields

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        context = {
            "title": "Limit overrides",
            "page_help": "An override replaces a name's configured limit at runtime, for every key of the name, from "
            "the next claim on. 0 pauses the name: running tasks finish, new ones wait. Every change is kept in the "
            "override audit trail.",
            "empty_state": "No overrides: every name runs at its configured limit (or 1, a mutex, if unconfigured). "
            "Use “Add limit override” to pause or throttle a name.",
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)

    @admin.display(description="Limit", ordering="slot_limit")
    def limit_display(self, obj: Override) -> str:
        if obj.slot_limit == 0:
            return format_html('<strong style="color:#ba2121">{}</strong>', "0 — paused")
        return str(obj.slot_limit)

    @admin.display(description="Configured limit")
    def configured_display(self, obj: Override) -> str:
        if obj.configured_limit is not None:
            return str(obj.configured_limit)
        if obj.name in ledger_access.configured_names():
            return "in settings (not synced by a worker yet)"
        return format_html('<span style="color:#a66400" title="{}">{}</span>',
                           "No worker has this name in keyed_concurrency_limits: its keys default to 1 (mutex).",
                           UNCONFIGURED)

    @admin.display(description="Expires", ordering="expires_at")
    def expiry_display(self, obj: Override) -> str:
        if obj.expires_at is None:
            return "never (until cleared)"
        if obj.expires_at <= timezone.now():
            return format_html("lapsed {} ago (the next sweep removes it)", since(obj.expires_at))
        return format_html('<span title="{}">in {}</span>', moment(obj.expires_at),
                           age(obj.expires_at - timezone.now()))

    @admin.display(description="")
    def clear_link(self, obj: Override) -> str:
        return format_html('<a class="button" href="{}">Clear…</a>', _url("override_clear", obj.name))

    @admin.display(description="Audit trail")
    def audit_trail(self, obj: Override) -> str:
        rows = OverrideLog.objects.filter(name=obj.name).order_by("-at", "-id")[:25]
        known = obj.name in configured_names()
        if not rows:
            return "No entries."
        body = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} → {}</td><td>{}</td><td>{}</td></tr>",
            (
                (moment(r.at), r.author or "—", r.action,
                 _limit_text(r.old_limit, configured=known), _limit_text(r.new_limit, configured=known),
                 r.reason or "—",
                 "" if r.expires_at is None else f"until {moment(r.expires_at)}")
                for r in rows
            ),
        )
        more = _url("overridelog_changelist", query={"name": obj.name})
        return format_html(
            '<table><thead><tr><th>When</th><th>Who</th><th>Action</th><th>Old → new</th><th>Why</th>'
            "<th>Expiry</th></tr></thead><tbody>{}</tbody></table><p><a href=\"{}\">Full audit trail of {}</a></p>",
            body, more, obj.name,
        )

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        initial = super().get_changeform_initial_data(request)
        if "name" in initial and (current := Override.objects.filter(name=initial["name"]).first()) is not None:
            initial.setdefault("slot_limit", current.slot_limit)
        return initial

    def save_model(self, request: HttpRequest, obj: Override, form: Any, change: bool) -> None:
        """Through the ledger (never ``obj.save()``): upsert + audit entry + promotions, in one transaction."""
        author = request.user.get_username()
        promotions = ledger_access.get_ledger().set_override(
            obj.name, obj.slot_limit, reason=obj.reason, author=author, expires_at=obj.expires_at
        )
        started = ledger_access.dispatch(promotions)
        request._keyed_said = True
        state = "paused" if obj.slot_limit == 0 else f"limited to {obj.slot_limit} per key"
        # The name as written (a name is case-sensitive: never capitalised), after a capital of our own.
        messages.success(request, f"Name “{obj.name}” is now {state} (from its next claim on). "
                                  f"Reason recorded: {obj.reason}")
        log_action(request, [obj], CHANGE if change else ADDITION,
                   f"Limit set to {_limit_text(obj.slot_limit)}: {obj.reason}")
        if promotions:
            messages.info(request, _promotions_text(promotions, started))
        if obj.name not in configured_names():
            seen = Key.objects.filter(name=obj.name).exists()
            messages.warning(
                request,
                f"“{obj.name}” is not a configured name (not in keyed_concurrency_limits, not synced by any worker)"
                + ("." if seen else ", and no key of it has been seen yet: check the spelling.")
                + " The override applies to its keys all the same.",
            )

    def message_user(self, request: HttpRequest, message: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(request, "_keyed_said", False):
            return  # save_model said what happened, in the operator's words; skip Django's "was added" line
        super().message_user(request, message, *args, **kwargs)

    def log_addition(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None  # save_model writes the admin log entry, in the operator's words (and the ledger's audit row)

    def log_change(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None

    def get_urls(self) -> list[Any]:
        return [
            path("<str:object_id>/clear/", self.admin_site.admin_view(self.clear_view), name=f"{APP}_override_clear"),
            *super().get_urls(),
        ]

    def clear_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        override = get_object_or_404(_limits(Override.objects.all()), name=object_id)
        if not self.has_change_permission(request, override):
            raise PermissionDenied
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            promotions = ledger_access.get_ledger().clear_override(
                override.name, reason=form.cleaned_data["reason"], author=request.user.get_username()
            )
            started = ledger_access.dispatch(promotions)
            limit = override.configured_limit if override.configured_limit is not None else 1
            messages.success(request, f"Override of “{override.name}” cleared: its keys run at the configured limit "
                                      f"({limit}) again.")
            log_action(request, [override], DELETION, f"Override cleared: {form.cleaned_data['reason']}")
            if promotions:
                messages.info(request, _promotions_text(promotions, started))
            return HttpResponseRedirect(_url("override_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": f"Clear the override of {override.name}?",
            "opts": self.model._meta,
            "override": override,
            "configured": override.configured_limit,
            "form": form,
        }
        return TemplateResponse(request, f"admin/{APP}/override/clear.html", context)



@admin.register(Name)
class NameAdmin(ReadOnlyAdmin):
    list_display = ("name", "slot_limit", "override_display", "effective_display", "shards", "max_waiting",
                    "max_wait", "overflow", "rate_display", "cap_display", "fair", "fair_weights", "config_version",
                    "updated_at")
    search_fields = ("name",)
    ordering = ("name",)
    list_title = "Configured names"
    page_help = (
        "Names configured in keyed_concurrency_limits, as the workers synced them at start. A key "
        "“name:ident” of a name not listed here is a mutex (limit 1). Configuration version: the "
        "keyed_config_version of the worker that stored it; a worker with an older version never overwrites it "
        "(see Workers for the version each worker runs)."
    )
    empty_state = "No configured names yet: workers sync keyed_concurrency_limits here when they start."

    def get_queryset(self, request: HttpRequest) -> QuerySet[Name]:
        return _limits(super().get_queryset(request))

    @admin.display(description="Cap of the name")
    def cap_display(self, obj: Any) -> str:
        """The cap on all the keys of the name together, and whether its keys borrow its idle room; or "-"."""
        if obj.cap is None:
            return "-"
        return f"{obj.cap}" + (", borrowing" if obj.borrow else "")

    @admin.display(description="Rate per key")
    def rate_display(self, obj: Any) -> str:
        """The token bucket ("6/s, burst 3") and the rate windows ("100/m", "10000/d"), or "-"."""
        said = []
        if obj.rate is not None:
            said.append(rate_text(obj.rate) + (f", burst {obj.burst:g}" if obj.burst else ""))
        said += [window_text(int(n), float(t)) for n, t in (obj.windows or ())]
        return "; ".join(said) or "-"

    @admin.display(description="Override")
    def override_display(self, obj: Any) -> str:
        limit, source = _limit_and_source(obj)
        link = _override_link(obj.name, source == "override")
        if source != "override":
            return format_html('<a href="{}">set…</a>', link)
        return format_html('<a href="{}">{}</a>', link, _limit_text(limit))

    @admin.display(description="Effective limit")
    def effective_display(self, obj: Any) -> str:
        limit, source = _limit_and_source(obj)
        return _limit_text(limit) + f" ({source})"

