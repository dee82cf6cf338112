"""Operators' forms: a limit override (set / change), and the reason every destructive action asks for."""

from __future__ import annotations

from typing import Any

from django import forms
from django.utils import timezone

from celery_keyed.ledger.bounds import SLOT_LIMIT_MAX
from celery_keyed.ledger.errors import InvalidKey
from celery_keyed.ledger.keyspec import validate_name
from celery_keyed_django.models import Override


class OverrideForm(forms.ModelForm):
    """Set or change the runtime limit of a name. Validation mirrors the ledger's (which checks again)."""

    name = forms.CharField(
        label="Name",
        max_length=64,
        help_text="The part of a key before the first ':' (e.g. <code>stripe</code> for every key "
        "<code>stripe:*</code>). Names not configured anywhere are allowed, and flagged.",
        widget=forms.TextInput(attrs={"size": 30, "autofocus": True, "placeholder": "e.g. stripe"}),
    )
    slot_limit = forms.IntegerField(
        label="Limit",
        min_value=0,
        max_value=SLOT_LIMIT_MAX,
        help_text="Tasks of one key that may run at once, cluster-wide. <strong>0 pauses the name</strong>: running "
        "tasks finish, no new ones start. Lowering never stops running tasks.",
        error_messages={
            "invalid": "Enter a whole number: 0 or more (0 pauses the name).",
            "min_value": "The limit cannot be negative: enter 0 to pause the name, or a positive number.",
            "max_value": f"The limit can be at most {SLOT_LIMIT_MAX} (what the ledger can store).",
            "required": "Enter a limit: 0 pauses the name.",
        },
        widget=forms.NumberInput(attrs={"min": 0, "max": SLOT_LIMIT_MAX, "step": 1, "style": "width: 8em"}),
    )
    reason = forms.CharField(
        label="Reason",
        max_length=500,
        help_text="Why: shown in the audit trail and to whoever looks at this name next (required).",
        error_messages={"required": "Say why: the reason is kept in the audit trail."},
        widget=forms.TextInput(attrs={"size": 70, "placeholder": "e.g. Stripe incident INC-123: back off"}),
    )
    expires_at = forms.SplitDateTimeField(
        label="Expires",
        required=False,
        help_text="Optional (server time zone). After this time the override lapses by itself and the configured "
        "limit applies again. Leave empty to keep it until someone clears it.",
        widget=forms.SplitDateTimeWidget(date_attrs={"type": "date"}, time_attrs={"type": "time"}),
    )

    class Meta:
        model = Override
        fields = ("name", "slot_limit", "reason", "expires_at")

    def clean_name(self) -> str:
        name = str(self.cleaned_data["name"]).strip()
        try:
            validate_name(name)
        except InvalidKey as exc:
            raise forms.ValidationError(
                f"“{name}” is not a valid name: a name starts with a letter, then letters, digits, '_', '.' or "
                "'-' (at most 64 characters), and has no ':'."
            ) from exc
        return name

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
        # An existing override of the name is replaced (set_override is an upsert); no uniqueness error.
        return


class ReasonForm(forms.Form):
    """The reason an operator gives for a destructive action (forced release, cancel, clear)."""

    reason = forms.CharField(
        label="Reason",
        max_length=500,
        error_messages={"required": "Say why: the reason is recorded."},
        widget=forms.TextInput(attrs={"size": 70, "autofocus": True}),
    )

    def clean_reason(self) -> str:
        reason = str(self.cleaned_data["reason"]).strip()
        if not reason:
            raise forms.ValidationError("Say why: the reason is recorded.")
        return reason


class ExplainForm(forms.Form):
    task_id = forms.CharField(
        label="Task id",
        max_length=255,
        widget=forms.TextInput(attrs={"size": 45, "autofocus": True, "placeholder": "a Celery task id"}),
    )
