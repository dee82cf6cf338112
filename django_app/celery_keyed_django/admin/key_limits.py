"""Limits of keys: pause one key (not its whole name) or give it a limit of its own, change or end either, with the
audit trail (the overrides' own, ``keyed_override_log``, filtered by key).

Writes go through the ledger (``Ledger.pause_key`` / ``resume_key`` / ``set_key_limit`` / ``clear_key_limit``: the
row, its audit entry and the promotions in one transaction), never through the read-only model; promotions are
dispatched like those of a name's override. Who may write: ``change_limits``, as for names.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.models import ADDITION, CHANGE, DELETION
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from celery_keyed.ledger import SECONDS_MAX, SLOT_LIMIT_MAX, InvalidKey, normalize_key
from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.rendering import APP, CHANGE_LIMITS, _promotions_text, _url, age, log_action, moment
from celery_keyed_django.bad_input import RefusesBadInput
from celery_keyed_django.forms import ReasonForm
from celery_keyed_django.models import KeyOverride, OverrideLog


class KeyOverrideForm(forms.ModelForm):
    """Pause a key and / or give it a limit of its own (the ledger checks again)."""

    key = forms.CharField(
        label="Key",
        max_length=200,
        help_text="One concurrency key, e.g. <code>stripe:acct_42</code>: only this key, not the other keys of its "
        "name.",
        widget=forms.TextInput(attrs={"size": 40, "autofocus": True, "placeholder": "e.g. stripe:acct_42"}),
    )
    pause_for = forms.FloatField(
        label="Pause for (seconds)",
        required=False,
        min_value=0.001,
        max_value=SECONDS_MAX,
        help_text="Optional. No task of the key starts before then (running ones finish; waiting ones keep their "
        "places). A pause is only ever extended; “Resume” ends it.",
    )
    slot_limit = forms.IntegerField(
        label="Own limit",
        required=False,
        min_value=0,
        max_value=SLOT_LIMIT_MAX,
        help_text="Optional. Tasks of this key that may run at once, instead of its name's limit (0 stops the key "
        "until the limit is cleared or expires). Lowering never stops running tasks.",
    )
    expires_at = forms.SplitDateTimeField(
        label="Limit expires",
        required=False,
        help_text="Optional (server time zone): the own limit lapses by itself then.",
        widget=forms.SplitDateTimeWidget(date_attrs={"type": "date"}, time_attrs={"type": "time"}),
    )
    reason = forms.CharField(
        label="Reason",
        max_length=500,
        error_messages={"required": "Say why: the reason is kept in the audit trail."},
        widget=forms.TextInput(attrs={"size": 70, "placeholder": "e.g. vendor incident: back off this account"}),
    )

    class Meta:
        model = KeyOverride
        fields = ("key", "slot_limit", "expires_at", "reason")

    def clean_key(self) -> str:
        try:
            return normalize_key(str(self.cleaned_data["key"]).strip())
        except InvalidKey as exc:
            raise forms.ValidationError(f"Not a valid key: {exc}") from exc

    def clean_reason(self) -> str:
        reason = str(self.cleaned_data["reason"]).strip()
        if not reason:
            raise forms.ValidationError("Say why: the reason is kept in the audit trail.")
        return reason

    def clean_expires_at(self) -> Any:
        expires = self.cleaned_data.get("expires_at")
        if expires is not None and expires <= timezone.now():
            raise forms.ValidationError("The expiry is in the past: pick a later time, or leave it empty.")
        return expires

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("pause_for") is None and data.get("slot_limit") is None and not self.errors:
            raise forms.ValidationError("Pause the key, give it a limit of its own, or both.")
        if data.get("expires_at") is not None and data.get("slot_limit") is None:
            self.add_error("expires_at", "An expiry belongs to an own limit: give the limit too.")
        return data

    def validate_unique(self) -> None:
        return  # an existing override of the key is changed (the ledger upserts): no uniqueness error


@admin.register(KeyOverride)
class KeyOverrideAdmin(RefusesBadInput, admin.ModelAdmin):
    """Per-key pauses and limits. Writes go through the ledger (audit trail, promotions)."""

    form = KeyOverrideForm
    change_list_template = f"admin/{APP}/change_list.html"
    list_display = ("key", "name", "paused_display", "limit_display", "resume_link", "clear_link")
    list_display_links = ("key",)
    search_fields = ("key", "pause_reason", "reason")
    ordering = ("key",)
    list_per_page = 100
    show_full_result_count = False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) or request.user.has_perm(CHANGE_LIMITS)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(CHANGE_LIMITS)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm(CHANGE_LIMITS)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # resume / clear are their own pages: they need a reason and go through the ledger

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        return {}

    def get_list_display(self, request: HttpRequest) -> Any:
        """No "Clear…" / "Resume…" button for whoever may only look (it would lead to a 403)."""
        shown = super().get_list_display(request)
        buttons = ("resume_link", "clear_link")
        return shown if self.has_change_permission(request) else [c for c in shown if c not in buttons]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = ["key", "pause_for", "slot_limit", "expires_at", "reason"]
        return [*fields, "audit_trail"] if obj is not None else fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("key", "audit_trail") if obj is not None else ()

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        context = {
            "title": "Key overrides",
            "page_help": "A pause or a limit of one key, not its whole name: set here, with `celery keyed pause-key` "
            "/ `set-key-limit`, or by a task of the key (self.keyed_pause on a 429, self.keyed_set_limit from a "
            "vendor's header). A paused key starts nothing new until the pause ends; its own limit replaces its "
            "name's. A paused name pauses every key. Every change is in the override audit trail.",
            "empty_state": "No key overrides: every key runs at its name's limit.",
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)

    @admin.display(description="Paused", ordering="paused_until")
    def paused_display(self, obj: KeyOverride) -> str:
        if obj.paused_until is None or obj.paused_until <= timezone.now():
            return "—"
        return format_html(
            '<strong style="color:#ba2121">paused</strong> for {} more <span title="{}">({}{})</span>',
            age(obj.paused_until - timezone.now()), moment(obj.paused_until), obj.pause_reason,
            f", {obj.pause_author}" if obj.pause_author else "",
        )

    @admin.display(description="Own limit", ordering="slot_limit")
    def limit_display(self, obj: KeyOverride) -> str:
        if obj.slot_limit is None or (obj.expires_at is not None and obj.expires_at <= timezone.now()):
            return "— (its name's)"
        until = "until cleared" if obj.expires_at is None else f"for {age(obj.expires_at - timezone.now())} more"
        return format_html("{} {} ({}{})", obj.slot_limit, until, obj.reason, f", {obj.author}" if obj.author else "")

    @admin.display(description="")
    def resume_link(self, obj: KeyOverride) -> str:
        if obj.paused_until is None or obj.paused_until <= timezone.now():
            return ""
        return format_html('<a class="button" href="{}">Resume…</a>', _url("keyoverride_resume", obj.key))

    @admin.display(description="")
    def clear_link(self, obj: KeyOverride) -> str:
        if obj.slot_limit is None:
            return ""
        return format_html('<a class="button" href="{}">Clear limit…</a>', _url("keyoverride_clear", obj.key))

    @admin.display(description="Audit trail")
    def audit_trail(self, obj: KeyOverride) -> str:
        rows = OverrideLog.objects.filter(key=obj.key).order_by("-at", "-id")[:25]
        if not rows:
            return "No entries."
        return format_html(
            "<table><thead><tr><th>When</th><th>Who</th><th>Action</th><th>Old → new</th><th>Why</th><th>Until</th>"
            "</tr></thead><tbody>{}</tbody></table>",
            format_html_join(
                "",
                "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} → {}</td><td>{}</td><td>{}</td></tr>",
                (
                    (moment(r.at), r.author or "the sweep", r.action,
                     "—" if r.old_limit is None else r.old_limit, "—" if r.new_limit is None else r.new_limit,
                     r.reason or "—",
                     "" if r.expires_at is None else moment(r.expires_at))
                    for r in rows
                ),
            ),
        )

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        initial = super().get_changeform_initial_data(request)
        if "key" in initial and (current := KeyOverride.objects.filter(key=initial["key"]).first()) is not None:
            initial.setdefault("slot_limit", current.slot_limit)
        return initial

    def save_model(self, request: HttpRequest, obj: KeyOverride, form: Any, change: bool) -> None:
        """Through the ledger (never ``obj.save()``): a pause and / or an own limit, each audited."""
        ledger = ledger_access.get_ledger()
        author = request.user.get_username()
        data = form.cleaned_data
        said = []
        promotions: list[Any] = []
        if data.get("pause_for") is not None:
            until, changed = ledger.pause_key(obj.key, data["pause_for"], reason=obj.reason or "", author=author)
            said.append(f"paused until {moment(until)}"
                        + ("" if changed else " (a longer pause was in force already)"))
        if data.get("slot_limit") is not None:
            promotions = ledger.set_key_limit(
                obj.key, data["slot_limit"], reason=obj.reason or "", author=author, expires_at=data.get("expires_at")
            )
            said.append(f"limited to {data['slot_limit']} on its own")
        started = ledger_access.dispatch(promotions)
        request._keyed_said = True
        messages.success(request, f"Key “{obj.key}” is now {' and '.join(said)}. Reason recorded: {obj.reason}")
        log_action(request, [obj], CHANGE if change else ADDITION, f"Key {' and '.join(said)}: {obj.reason}")
        if promotions:
            messages.info(request, _promotions_text(promotions, started))

    def message_user(self, request: HttpRequest, message: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(request, "_keyed_said", False):
            return
        super().message_user(request, message, *args, **kwargs)

    def log_addition(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None  # save_model writes the entry in the operator's words (and the ledger its audit row)

    def log_change(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None

    def get_urls(self) -> list[Any]:
        return [
            path("<path:object_id>/resume/", self.admin_site.admin_view(self.resume_view),
                 name=f"{APP}_keyoverride_resume"),
            path("<path:object_id>/clear-limit/", self.admin_site.admin_view(self.clear_view),
                 name=f"{APP}_keyoverride_clear"),
            *super().get_urls(),
        ]

    def resume_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._end_view(request, object_id, "resume")

    def clear_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._end_view(request, object_id, "clear")

    def _end_view(self, request: HttpRequest, object_id: str, what: str) -> HttpResponse:
        """End the key's pause (``resume``) or its own limit (``clear``), with a reason, through the ledger."""
        override = get_object_or_404(KeyOverride.objects.all(), key=object_id)
        if not self.has_change_permission(request, override):
            raise PermissionDenied
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            ledger = ledger_access.get_ledger()
            reason, author = form.cleaned_data["reason"], request.user.get_username()
            if what == "resume":
                promotions = ledger.resume_key(override.key, reason=reason, author=author)
                done = "resumed: its waiting tasks start as its limit allows"
            else:
                promotions = ledger.clear_key_limit(override.key, reason=reason, author=author)
                done = "back to its name's limit"
            started = ledger_access.dispatch(promotions or [])
            messages.success(request, f"Key “{override.key}” {done}." if promotions is not None
                             else f"Key “{override.key}”: nothing to end (it lapsed meanwhile).")
            log_action(request, [override], DELETION if what == "clear" else CHANGE, f"Key {what}: {reason}")
            if promotions:
                messages.info(request, _promotions_text(promotions, started))
            return HttpResponseRedirect(_url("keyoverride_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": f"{'Resume' if what == 'resume' else 'Clear the own limit of'} {override.key}?",
            "opts": self.model._meta,
            "override": override,
            "what": what,
            "form": form,
        }
        return TemplateResponse(request, f"admin/{APP}/keyoverride/end.html", context)

