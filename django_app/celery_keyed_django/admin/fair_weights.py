"""Limits of fair sharing: runtime fair weight overrides (set, change, clear; their audit trail is in
``history``).

Writes go through the ledger (``Ledger.set_fair_weight`` / ``clear_fair_weight``: upsert + audit row in one
transaction), never through the read-only models. Who may write: the same permission as limit overrides
(``change_limits``): both steer how a name's slots are handed out.
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
from django.utils.html import format_html

from celery_keyed.ledger import FAIR_WEIGHT_MAX, FAIR_WEIGHT_MIN, InvalidConfig, check_prefix, validate_name
from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.rendering import APP, CHANGE_LIMITS, _url, age, log_action, moment, moment_column, since
from celery_keyed_django.bad_input import RefusesBadInput
from celery_keyed_django.forms import ReasonForm
from celery_keyed_django.models import FairWeightOverride, Name


class FairWeightForm(forms.ModelForm):
    """Set or change the runtime weight of the fair keys of a name matching a prefix (the ledger checks again)."""

    name = forms.CharField(
        label="Name",
        max_length=64,
        help_text="A name configured <code>fair</code> (the part of a key before the first ':').",
        widget=forms.TextInput(attrs={"size": 30, "autofocus": True, "placeholder": "e.g. crm"}),
    )
    prefix = forms.CharField(
        label="Fair-key prefix",
        max_length=300,
        help_text="The fair keys it weighs: those equal to it or starting with it and ':' (<code>tenant</code> "
        "weighs every <code>tenant:*</code>; <code>tenant:big</code> only that tenant). The longest match wins.",
        widget=forms.TextInput(attrs={"size": 40, "placeholder": "e.g. tenant:big"}),
    )
    weight = forms.FloatField(
        label="Weight",
        min_value=FAIR_WEIGHT_MIN,
        max_value=FAIR_WEIGHT_MAX,
        help_text="While several fair keys wait, each one's share of a key's slots follows its weight (default 1). "
        "Takes effect at the next promotion; never stops running tasks.",
        widget=forms.NumberInput(attrs={"step": "any", "style": "width: 8em"}),
    )
    reason = forms.CharField(
        label="Reason",
        max_length=500,
        help_text="Why: shown in the audit trail (required).",
        widget=forms.TextInput(attrs={"size": 70}),
    )
    expires_at = forms.SplitDateTimeField(
        label="Expires",
        required=False,
        help_text="Optional. After this time the override lapses and the call's or configured weight applies again.",
        widget=forms.SplitDateTimeWidget(date_attrs={"type": "date"}, time_attrs={"type": "time"}),
    )

    class Meta:
        model = FairWeightOverride
        fields = ("name", "prefix", "weight", "reason", "expires_at")

    def clean_name(self) -> str:
        name = str(self.cleaned_data["name"]).strip()
        try:
            return validate_name(name)
        except Exception as exc:
            raise forms.ValidationError(f"“{name}” is not a valid name.") from exc

    def clean_prefix(self) -> str:
        prefix = str(self.cleaned_data["prefix"]).strip()
        try:
            return check_prefix(prefix, "prefix")
        except InvalidConfig as exc:
            raise forms.ValidationError(str(exc)) from exc

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

    def validate_unique(self) -> None:
        return  # an existing override of (name, prefix) is replaced (set_fair_weight is an upsert)


def _configured_weight(name: str, prefix: str) -> float | None:
    table = Name.objects.filter(name=name).values_list("fair_weights", flat=True).first()
    return None if not table else table.get(prefix)


@admin.register(FairWeightOverride)
class FairWeightOverrideAdmin(RefusesBadInput, admin.ModelAdmin):
    form = FairWeightForm
    change_list_template = f"admin/{APP}/change_list.html"
    list_display = ("name", "prefix", "weight", "configured_display", "reason", "author",
                    moment_column("set_at", "Set at"), "expiry_display",
                    "clear_link")
    list_display_links = ("name", "prefix")
    search_fields = ("name", "prefix", "reason", "author")
    ordering = ("name", "prefix")
    list_per_page = 100
    show_full_result_count = False

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) or request.user.has_perm(CHANGE_LIMITS)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(CHANGE_LIMITS)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm(CHANGE_LIMITS)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # clearing is its own page: it asks for a reason and goes through clear_fair_weight

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        return {}

    def get_list_display(self, request: HttpRequest) -> Any:
        """No "Clear…" / "Resume…" button for whoever may only look (it would lead to a 403)."""
        shown = super().get_list_display(request)
        return shown if self.has_change_permission(request) else [c for c in shown if c != "clear_link"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("name", "prefix") if obj is not None else ()

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        context = {
            "title": "Fair weight overrides",
            "page_help": "A fair name's waiters share each key's slots by the weight of their fair key: while several "
            "fair keys wait, the next slot goes to the one holding the fewest slots for its weight. An override "
            "replaces the weight the tasks carry and the configured table (keyed_fair_weights) for the fair keys it "
            "matches, from the next promotion on. Every change is kept in the fair weight audit trail.",
            "empty_state": "No fair weight overrides: every fair key has the weight its tasks carry, else the "
            "configured one, else 1.",
            **(extra_context or {}),
        }
        return super().changelist_view(request, extra_context=context)

    @admin.display(description="Configured weight")
    def configured_display(self, obj: FairWeightOverride) -> str:
        weight = _configured_weight(obj.name, obj.prefix)
        return "—" if weight is None else f"{weight:g}"

    @admin.display(description="Expires", ordering="expires_at")
    def expiry_display(self, obj: FairWeightOverride) -> str:
        if obj.expires_at is None:
            return "never (until cleared)"
        if obj.expires_at <= timezone.now():
            return format_html("lapsed {} ago", since(obj.expires_at))
        return format_html('<span title="{}">in {}</span>', moment(obj.expires_at),
                           age(obj.expires_at - timezone.now()))

    @admin.display(description="")
    def clear_link(self, obj: FairWeightOverride) -> str:
        return format_html('<a class="button" href="{}">Clear…</a>', _url("fairweightoverride_clear", obj.pk))

    def save_model(self, request: HttpRequest, obj: FairWeightOverride, form: Any, change: bool) -> None:
        """Through the ledger (never ``obj.save()``): upsert + audit entry in one transaction."""
        ledger_access.get_ledger().set_fair_weight(
            obj.name, obj.prefix, obj.weight, reason=obj.reason, author=request.user.get_username(),
            expires_at=obj.expires_at,
        )
        request._keyed_said = True
        messages.success(request, f"Fair keys “{obj.prefix}” of “{obj.name}” now weigh {obj.weight:g} (from the "
                                  f"next promotion on). Reason recorded: {obj.reason}")
        saved = FairWeightOverride.objects.filter(name=obj.name, prefix=obj.prefix).first()
        log_action(request, [saved] if saved is not None else [], CHANGE if change else ADDITION,
                   f"Fair weight set to {obj.weight:g}: {obj.reason}")

    def message_user(self, request: HttpRequest, message: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(request, "_keyed_said", False):
            return
        super().message_user(request, message, *args, **kwargs)

    def log_addition(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None

    def log_change(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None

    def response_add(self, request: HttpRequest, obj: Any, post_url_continue: Any = None) -> HttpResponse:
        return HttpResponseRedirect(_url("fairweightoverride_changelist"))

    def response_change(self, request: HttpRequest, obj: Any) -> HttpResponse:
        return HttpResponseRedirect(_url("fairweightoverride_changelist"))

    def get_urls(self) -> list[Any]:
        return [
            path("<int:object_id>/clear/", self.admin_site.admin_view(self.clear_view),
                 name=f"{APP}_fairweightoverride_clear"),
            *super().get_urls(),
        ]

    def clear_view(self, request: HttpRequest, object_id: int) -> HttpResponse:
        override = get_object_or_404(FairWeightOverride.objects.all(), pk=object_id)
        if not self.has_change_permission(request, override):
            raise PermissionDenied
        form = ReasonForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            ledger_access.get_ledger().clear_fair_weight(
                override.name, override.prefix, reason=form.cleaned_data["reason"],
                author=request.user.get_username(),
            )
            configured = _configured_weight(override.name, override.prefix)
            messages.success(
                request,
                f"Fair weight override of “{override.prefix}” of “{override.name}” cleared: those fair keys weigh what "
                f"their tasks carry, else {'the configured ' + format(configured, 'g') if configured else '1'}.",
            )
            log_action(request, [override], DELETION, f"Fair weight override cleared: {form.cleaned_data['reason']}")
            return HttpResponseRedirect(_url("fairweightoverride_changelist"))
        context = {
            **self.admin_site.each_context(request),
            "title": f"Clear the fair weight override of {override.prefix} ({override.name})?",
            "opts": self.model._meta,
            "override": override,
            "configured": _configured_weight(override.name, override.prefix),
            "form": form,
        }
        return TemplateResponse(request, f"admin/{APP}/fairweightoverride/clear.html", context)
