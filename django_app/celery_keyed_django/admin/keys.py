"""Keys, the live view: one row per key with its limit and where it comes from, tasks in flight and waiting, the
oldest wait and its pauses. Each column is one indexed lookup per shown row (no N+1, no count of the whole table),
so the page stays quick on hundreds of thousands of keys; it reloads itself while no row is selected."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.db.models import Exists, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce, Now
from django.http import HttpRequest
from django.utils.html import format_html

from celery_keyed.ledger import EXCLUSIVE_COST
from celery_keyed_django.admin.base import (
    ReadOnlyAdmin,
    _key_limit_and_source,
    _limit_and_source,
    _limits,
    _names_by_limit,
    _override_link,
    configured_names,
)
from celery_keyed_django.admin.rendering import UNCONFIGURED, _url, moment, since
from celery_keyed_django.models import CallLimit, Key, KeyOverride, Override, Slot, Waiting


class NameFilter(admin.SimpleListFilter):
    title = "name"
    parameter_name = "name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # Configured and overridden names (small tables), and the names of busy keys — a name configured nowhere
        # runs on the default mutex and must be listed while it has tasks in flight or waiting (one query).
        busy = (Slot.objects.filter(used__gt=0).values_list("name", flat=True)
                .union(Key.objects.filter(waiting__gt=0).values_list("name", flat=True)))
        names = configured_names() | set(Override.objects.values_list("name", flat=True)) | set(busy)
        return [(n, n) for n in sorted(names)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(name=self.value()) if self.value() else queryset


class LimitSourceFilter(admin.SimpleListFilter):
    title = "limit from"
    parameter_name = "source"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("override", "an override"), ("config", "configuration"), ("default", "the default (1)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        # keyed_limits lists every name with a source other than the default (ledger migration 0020).
        if self.value() == "override":
            return queryset.filter(name__in=_names_by_limit("override"))
        if self.value() == "config":
            return queryset.filter(name__in=_names_by_limit("config"))
        if self.value() == "default":
            return queryset.exclude(name__in=_names_by_limit())
        return queryset


class KeyStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("paused", "paused (limit 0)"), ("waiting", "has waiting tasks"), ("running", "has tasks in flight"),
                ("idle", "idle")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        busy = Exists(Slot.objects.filter(key=OuterRef("key"), used__gt=0))
        if self.value() == "paused":
            return queryset.filter(name__in=_names_by_limit(paused=True))
        if self.value() == "waiting":
            return queryset.filter(waiting__gt=0)
        if self.value() == "running":
            return queryset.filter(busy)
        if self.value() == "idle":
            return queryset.filter(waiting=0).exclude(busy)
        return queryset


@admin.register(Key)
class KeyAdmin(ReadOnlyAdmin):
    """The live view: one row per key, each column one indexed lookup for the rows on the page."""

    list_display = ("key", "name_link", "limit_display", "in_flight_display", "waiting_display", "active_display")
    list_display_links = None
    list_filter = (NameFilter, LimitSourceFilter, KeyStateFilter)
    search_fields = ("key",)
    ordering = ("key",)
    sortable_by = ("key", "waiting", "active_at")
    list_title = "Keys — live view"
    page_help = (
        "Every key the ledger knows: its limit and where it comes from, tasks in flight and waiting, and "
        "how long the oldest has waited. Idle keys are dropped after keyed_idle_key_ttl."
    )
    empty_state = "No keys yet: a key appears here when its first keyed task arrives at a worker."
    auto_refresh = True

    def get_queryset(self, request: HttpRequest) -> QuerySet[Key]:
        in_flight = Slot.objects.filter(key=OuterRef("key")).values("key").annotate(total=Sum("used")).values("total")
        oldest = Waiting.objects.filter(key=OuterRef("key"), shadow=False).order_by("arrival").values("arrived_at")
        own = KeyOverride.objects.filter(key=OuterRef("key"))  # a key's own pause or limit
        return _limits(super().get_queryset(request)).annotate(
            in_flight=Coalesce(Subquery(in_flight[:1]), 0),
            oldest_waiting=Subquery(oldest[:1]),
            key_paused_until=Subquery(own.filter(paused_until__gt=Now()).values("paused_until")[:1]),
            key_limit=Subquery(
                own.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=Now())).values("slot_limit")[:1]
            ),
            call_limit=Subquery(CallLimit.objects.filter(key=OuterRef("key")).values("slot_limit")[:1]),
        )

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Any], search_term: str) -> Any:
        """A key is found by its exact value or by what it starts with (``account:`` lists that name's keys)."""
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(Q(key=term) | Q(key__startswith=term)), False

    @admin.display(description="Name", ordering="name")
    def name_link(self, obj: Any) -> str:
        return format_html('<a href="{}" title="Set or change the override of {}">{}</a>',
                           _override_link(obj.name, _limit_and_source(obj)[1] == "override"), obj.name, obj.name)

    @admin.display(description="Limit")
    def limit_display(self, obj: Any) -> str:
        """The key's limit (or paused, and until when), then where it comes from in smaller type."""
        limit, source = _key_limit_and_source(obj)
        if source == "key_paused":
            shown = format_html('<strong style="color:#ba2121">paused</strong> until {}', moment(obj.key_paused_until))
        elif limit == 0:
            shown = format_html('<strong style="color:#ba2121">{}</strong>', "paused")
        else:
            shown = format_html("{}", limit)
        return format_html('{}<br><span class="keyed-sub">{}</span>', shown, self.source_display(obj))

    def source_display(self, obj: Any) -> str:
        source = _key_limit_and_source(obj)[1]
        label = {"override": "override", "config": "configuration", "default": UNCONFIGURED,
                 "key_paused": "the key's pause", "key": "the key's own limit",
                 "call": "its latest call"}[source]
        if source.startswith("key"):
            return format_html('<a href="{}">{}</a>', _url("keyoverride_change", quote(obj.key)), label)
        return label

    @admin.display(description="In flight")
    def in_flight_display(self, obj: Any) -> str:
        if not obj.in_flight:
            return "0"
        # An exclusive holder (readers and writers) holds EXCLUSIVE_COST slots: shown as the one task it is.
        tasks = obj.in_flight % EXCLUSIVE_COST + obj.in_flight // EXCLUSIVE_COST
        return format_html('<a href="{}">{}</a>', _url("claim_changelist", query={"key": obj.key}), tasks)

    @admin.display(description="Waiting (oldest)", ordering="waiting")
    def waiting_display(self, obj: Any) -> str:
        if not obj.waiting:
            return "0"
        return format_html('<a href="{}">{}</a><br><span class="keyed-sub">oldest {}</span>',
                           _url("waiting_changelist", query={"key": obj.key}), obj.waiting, since(obj.oldest_waiting))

    @admin.display(description="Last active", ordering="active_at")
    def active_display(self, obj: Any) -> str:
        return since(obj.active_at) + " ago"

