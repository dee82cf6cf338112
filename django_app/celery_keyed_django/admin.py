"""The operators' admin: limit overrides (with their audit trail), a live view of keys, claims (force release),
waiting tasks (cancel), outcome history, ledger events, and an "explain" panel for a task id.

Every screen reads through the read-only models; every change goes through the ledger's functions (set_override,
clear_override, the fenced release, revoke), which keep the counters, the audit trail and the promotions right,
and then the promotions they made are dispatched (``celery_keyed_django.ledger.dispatch``). Lists of keys, claims,
waiting tasks and outcomes are paginated and each column is one indexed lookup per shown row (no N+1, no count of
the whole table), so they stay quick on hundreds of thousands of rows.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Literal

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.db.models import CharField, Count, Exists, F, Func, IntegerField, Max, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, Now
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode

from celery_keyed.ledger import EXCLUSIVE_COST, Token, limited_names_sql, name_limit_sql
from celery_keyed.ledger.admin_queries import force_release
from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.bad_input import RefusesBadInput
from celery_keyed_django.forms import ExplainForm, OverrideForm, ReasonForm
from celery_keyed_django.models import (
    OUTCOMES,
    Claim,
    Event,
    Holder,
    Key,
    KeyOverride,
    Name,
    Outbox,
    Override,
    OverrideLog,
    SendRefusals,
    Sent,
    Slot,
    TaskRecord,
    Waiting,
)

APP = "celery_keyed_django"
CHANGE_LIMITS = f"{APP}.change_limits"


# -- small renderers ---------------------------------------------------------------------------------------------


def age(delta: timedelta | None) -> str:
    """A duration as an operator reads it: ``45s``, ``3m 05s``, ``2h 04m``, ``3d 4h``."""
    if delta is None:
        return "—"
    seconds = int(delta.total_seconds())
    sign, seconds = ("-", -seconds) if seconds < 0 else ("", seconds)
    if seconds < 60:
        return f"{sign}{seconds}s"
    if seconds < 3600:
        return f"{sign}{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{sign}{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{sign}{seconds // 86400}d {seconds % 86400 // 3600}h"


def since(moment: datetime | None) -> str:
    return "—" if moment is None else age(timezone.now() - moment)


def _url(name: str, *args: Any, query: dict[str, Any] | None = None) -> str:
    url = reverse(f"admin:{APP}_{name}", args=args)
    return f"{url}?{urlencode(query)}" if query else url


def explain_link(task_id: str) -> str:
    """A task id, shortened to its first 8 characters (the full id in the tooltip), linking to its explanation."""
    short = task_id if len(task_id) <= 12 else task_id[:8] + "…"
    return format_html('<a href="{}" title="{} — why is it (not) running?" style="white-space:nowrap">'
                       "<code>{}</code></a>", _url("explain", query={"task_id": task_id}), task_id, short)


def log_action(request: HttpRequest, objects: list[Any], flag: int, message: str) -> None:
    """Record an operator's action in Django's own admin log (the object's History, "Recent actions"), besides
    the ledger's audit trail; one entry per object."""
    if objects and request.user.is_authenticated:
        LogEntry.objects.log_actions(request.user.pk, objects, flag, change_message=message,
                                     single_object=len(objects) == 1)


def _task_name() -> Subquery:
    """The task's name, from the books (one indexed lookup per shown row)."""
    return Subquery(TaskRecord.objects.filter(task_id=OuterRef("task_id")).values("task_name")[:1])


def arguments_text(message: dict[str, Any] | None, limit: int = 120) -> str:
    """A stored message's arguments as Celery shows them (its ``argsrepr`` / ``kwargsrepr`` headers, which a task
    can set to hide secrets), shortened to ``limit`` characters."""
    headers = (message or {}).get("headers") or {}
    args, kwargs = headers.get("argsrepr"), headers.get("kwargsrepr")
    if args is None and kwargs is None:
        return "—"
    parts = [str(args)] if args not in (None, "()", "[]") else []
    if kwargs not in (None, "{}"):
        parts.append(str(kwargs))
    text = ", ".join(parts) or "no arguments"
    return text if len(text) <= limit else text[: limit - 1] + "…"


#: Seconds between reloads of the live pages (keys, claims, waiting tasks); paused while rows are selected.
AUTO_REFRESH_SECONDS = 10


def configured_names() -> set[str]:
    """Names configured in settings or synced to the ledger by a worker (keyed_names)."""
    return ledger_access.configured_names() | set(Name.objects.values_list("name", flat=True))


class ReadOnlyAdmin(RefusesBadInput, admin.ModelAdmin):
    """The ledger's rows are written by the ledger only: no add, change or delete through the ORM."""

    change_list_template = f"admin/{APP}/change_list.html"
    show_full_result_count = False  # never count a whole ledger table for the "(N total)" link
    list_per_page = 100
    show_facets = admin.ShowFacets.NEVER  # facet counts would count whole ledger tables on every page
    page_help = ""
    empty_state = "Nothing here."
    list_title = ""
    auto_refresh = False  # live pages reload every AUTO_REFRESH_SECONDS (not while rows are selected)

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        context = {"page_help": self.page_help, "empty_state": self.empty_state,
                   "auto_refresh": AUTO_REFRESH_SECONDS if self.auto_refresh else None, **(extra_context or {})}
        if self.list_title:
            context.setdefault("title", self.list_title)
        return super().changelist_view(request, extra_context=context)

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions


class _NameLimit(Func):
    """A name's effective limit (``slot_limit``) or its source (``source``: ``override``, ``config`` or ``default``)
    now, as the ledger decides it (``keyed_limits``, ledger migration 0020; the SQL ``celery keyed status`` reads):
    one indexed lookup per shown row."""

    def __init__(self, column: Literal["slot_limit", "source"], name: Any) -> None:
        output = IntegerField() if column == "slot_limit" else CharField()
        super().__init__(name, template=name_limit_sql(column, "%(expressions)s"), output_field=output)


def _limits(qs: QuerySet[Any]) -> QuerySet[Any]:
    """Annotate a queryset that has a ``name`` column with the name's effective limit and its source (from the
    ledger's ``keyed_limits``) and its configured limit."""
    return qs.annotate(
        name_limit=_NameLimit("slot_limit", F("name")),
        limit_source=_NameLimit("source", F("name")),
        configured_limit=Subquery(Name.objects.filter(name=OuterRef("name")).values("slot_limit")[:1]),
    )


def _limit_and_source(obj: Any) -> tuple[int, str]:
    """A name's effective limit and its source, as annotated by ``_limits``."""
    return obj.name_limit, obj.limit_source


def _names_by_limit(source: Literal["override", "config"] | None = None, paused: bool = False) -> RawSQL:
    """The names ``keyed_limits`` lists now (of ``source``, or paused), for ``name__in``: one semi-join."""
    return RawSQL(limited_names_sql(source=source, paused=paused), ())


def _key_limit_and_source(obj: Any) -> tuple[int, str]:
    """A key's limit as ``keyed_key_limit`` decides it: a paused name pauses every key; else the key's own pause
    (``key_paused``), else its own limit (``key``), else its name's."""
    limit, source = _limit_and_source(obj)
    if limit == 0:
        return limit, source
    if obj.key_paused_until is not None:
        return 0, "key_paused"
    if obj.key_limit is not None:
        return obj.key_limit, "key"
    return limit, source


def _override_link(name: str, has_override: bool) -> str:
    if has_override:
        return _url("override_change", name)
    return _url("override_add", query={"name": name})


# -- overrides -----------------------------------------------------------------------------------------------------


@admin.register(Override)
class OverrideAdmin(RefusesBadInput, admin.ModelAdmin):
    """Runtime limits per name. Writes go through ``set_override`` / ``clear_override`` (audit trail, promotions)."""

    form = OverrideForm
    change_list_template = f"admin/{APP}/change_list.html"
    list_display = ("name", "limit_display", "configured_display", "reason", "author", "set_at", "expiry_display",
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
        return format_html('<span style="color:#a66400" title="{}">⚠ not configured</span>',
                           "No worker has this name in keyed_concurrency_limits: its keys default to 1 (mutex).")

    @admin.display(description="Expires", ordering="expires_at")
    def expiry_display(self, obj: Override) -> str:
        if obj.expires_at is None:
            return "never (until cleared)"
        if obj.expires_at <= timezone.now():
            return format_html("lapsed {} ago (the next sweep removes it)", since(obj.expires_at))
        return format_html('<span title="{}">in {}</span>', obj.expires_at.isoformat(),
                           age(obj.expires_at - timezone.now()))

    @admin.display(description="")
    def clear_link(self, obj: Override) -> str:
        return format_html('<a class="button" href="{}">Clear…</a>', _url("override_clear", obj.name))

    @admin.display(description="Audit trail")
    def audit_trail(self, obj: Override) -> str:
        rows = OverrideLog.objects.filter(name=obj.name).order_by("-at", "-id")[:25]
        if not rows:
            return "No entries."
        body = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{} → {}</td><td>{}</td><td>{}</td></tr>",
            (
                (timezone.localtime(r.at).strftime("%Y-%m-%d %H:%M:%S"), r.author or "—", r.action,
                 _limit_text(r.old_limit), _limit_text(r.new_limit), r.reason or "—",
                 "" if r.expires_at is None else f"until {timezone.localtime(r.expires_at):%Y-%m-%d %H:%M}")
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


def _limit_text(limit: int | None) -> str:
    if limit is None:
        return "configured"
    return "0 (paused)" if limit == 0 else str(limit)


def _promotions_text(promotions: list[Any], started: int) -> str:
    n = len(promotions)
    text = f"{n} waiting task{'s' if n != 1 else ''} got a slot at once"
    them = "them" if n != 1 else "it"
    if started < n:
        return text + f"; a worker starts {them} within the dispatch timeout (no Celery app here to publish {them})."
    return text + (" and were sent to the workers." if n != 1 else " and was sent to the workers.")


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
        return format_html('<span title="{} ago">{}</span>', since(obj.at), timezone.localtime(obj.at).strftime(
            "%Y-%m-%d %H:%M:%S"))

    @admin.display(description="Expiry")
    def expiry_display(self, obj: OverrideLog) -> str:
        return "—" if obj.expires_at is None else timezone.localtime(obj.expires_at).strftime("%Y-%m-%d %H:%M")

    @admin.display(description="Old → new")
    def change_display(self, obj: OverrideLog) -> str:
        return f"{_limit_text(obj.old_limit)} → {_limit_text(obj.new_limit)}"

    @admin.display(description="Who", ordering="author")
    def author_display(self, obj: OverrideLog) -> str:
        return obj.author or ("the sweep" if obj.action == "expire" else "—")


@admin.register(Name)
class NameAdmin(ReadOnlyAdmin):
    list_display = ("name", "slot_limit", "override_display", "effective_display", "shards", "max_waiting",
                    "max_wait", "overflow", "rate", "fair", "fair_weights", "config_version", "updated_at")
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


# -- keys (the live view) ------------------------------------------------------------------------------------------


class NameFilter(admin.SimpleListFilter):
    title = "name"
    parameter_name = "name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # Configured and overridden names only (small tables); any other name is reachable by search.
        names = configured_names() | set(Override.objects.values_list("name", flat=True))
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

    list_display = ("key", "name_link", "limit_display", "source_display", "in_flight_display", "waiting_display",
                    "oldest_display", "paused_display", "active_display")
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
        own = KeyOverride.objects.filter(key=OuterRef("key"))  # a key's own pause or limit (issue 14 item 4)
        return _limits(super().get_queryset(request)).annotate(
            in_flight=Coalesce(Subquery(in_flight[:1]), 0),
            oldest_waiting=Subquery(oldest[:1]),
            key_paused_until=Subquery(own.filter(paused_until__gt=Now()).values("paused_until")[:1]),
            key_limit=Subquery(
                own.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=Now())).values("slot_limit")[:1]
            ),
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
        return str(_key_limit_and_source(obj)[0])

    @admin.display(description="Limit from")
    def source_display(self, obj: Any) -> str:
        source = _key_limit_and_source(obj)[1]
        label = {"override": "override", "config": "configuration", "default": "default (mutex)",
                 "key_paused": "the key's pause", "key": "the key's own limit"}[source]
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

    @admin.display(description="Waiting", ordering="waiting")
    def waiting_display(self, obj: Any) -> str:
        if not obj.waiting:
            return "0"
        return format_html('<a href="{}">{}</a>', _url("waiting_changelist", query={"key": obj.key}), obj.waiting)

    @admin.display(description="Oldest waiting")
    def oldest_display(self, obj: Any) -> str:
        return since(obj.oldest_waiting) if obj.waiting else "—"

    @admin.display(description="Paused")
    def paused_display(self, obj: Any) -> str:
        limit, source = _key_limit_and_source(obj)
        if source == "key_paused":
            return format_html('<strong style="color:#ba2121">paused</strong> until {}',
                               timezone.localtime(obj.key_paused_until).strftime("%H:%M:%S"))
        if limit == 0:
            return format_html('<strong style="color:#ba2121">{}</strong>', "paused")
        return "—"

    @admin.display(description="Last active", ordering="active_at")
    def active_display(self, obj: Any) -> str:
        return since(obj.active_at) + " ago"


# -- claims ----------------------------------------------------------------------------------------------------------


@admin.register(Claim)
class ClaimAdmin(ReadOnlyAdmin):
    list_display = ("task_link", "task_name_display", "arguments_display", "attempt", "holds_display",
                    "state_display", "fence", "holder", "held_display", "lease_display")
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

    @admin.display(description="Task name")
    def task_name_display(self, obj: Claim) -> str:
        return getattr(obj, "task_name", None) or "—"

    @admin.display(description="Arguments")
    def arguments_display(self, obj: Claim) -> str:
        return arguments_text(obj.parked)  # the stored message of an attempt that waited (else not kept)

    @admin.display(description="Task", ordering="task_id")
    def task_link(self, obj: Claim) -> str:
        return explain_link(obj.task_id)

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
            return obj.state
        return format_html(
            '{} <span style="color:#ba2121">— cancel requested {} ago ({})</span>',
            obj.state, age(timezone.now() - obj.cancel_requested_at), obj.cancel_detail or "",
        )

    @admin.display(description="Held for", ordering="claimed_at")
    def held_display(self, obj: Claim) -> str:
        return since(obj.claimed_at)

    @admin.display(description="Lease left", ordering="lease_expires_at")
    def lease_display(self, obj: Claim) -> str:
        left = obj.lease_expires_at - timezone.now()
        if left.total_seconds() < 0:
            return format_html('<span style="color:#ba2121">lapsed {} ago</span>', age(-left))
        return age(left)

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


# -- waiting ---------------------------------------------------------------------------------------------------------


class WaitingStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("ready", "in line"), ("not_before", "not due yet (retry / ETA / debounce)"),
                ("blocked", "blocked behind its group"), ("shadow", "duplicate (shadow of a running attempt)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value == "ready":
            return queryset.filter(shadow=False, group_blocked=False, not_before__isnull=True)
        if value == "not_before":
            return queryset.filter(not_before__isnull=False)
        if value == "blocked":
            return queryset.filter(group_blocked=True)
        if value == "shadow":
            return queryset.filter(shadow=True)
        return queryset


@admin.register(Waiting)
class WaitingAdmin(ReadOnlyAdmin):
    list_display = ("task_link", "task_name_display", "arguments_display", "attempt", "key", "group_display",
                    "priority", "waited_display", "due_display", "deadline_display", "state_display", "queue")
    list_display_links = None
    list_filter = (WaitingStateFilter,)
    search_fields = ("=task_id", "=key", "=group_key")
    ordering = ("arrival",)
    actions = ("cancel_action",)
    list_title = "Waiting tasks"
    page_help = (
        "Parked tasks, stored in Postgres and acked at the broker, in arrival order (priority first within "
        "a key). Cancel revokes a task through the ledger: it leaves the line and its result is stored as revoked."
    )
    empty_state = "Nobody is waiting: every keyed task that arrived got a slot."
    auto_refresh = True

    def has_cancel_waiting_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{APP}.cancel_waiting")

    @admin.display(description="Task name")
    def task_name_display(self, obj: Waiting) -> str:
        return str((obj.message or {}).get("task") or "—")

    @admin.display(description="Arguments")
    def arguments_display(self, obj: Waiting) -> str:
        return arguments_text(obj.message)

    @admin.display(description="Task", ordering="task_id")
    def task_link(self, obj: Waiting) -> str:
        return explain_link(obj.task_id)

    @admin.display(description="Group (number)")
    def group_display(self, obj: Waiting) -> str:
        return "—" if obj.group_key is None else f"{obj.group_key} (#{obj.group_seq})"

    @admin.display(description="Waiting for", ordering="arrival")
    def waited_display(self, obj: Waiting) -> str:
        return since(obj.arrived_at)

    @admin.display(description="Not before")
    def due_display(self, obj: Waiting) -> str:
        if obj.not_before is None:
            return "—"
        left = obj.not_before - timezone.now()
        return f"in {age(left)}" if left.total_seconds() > 0 else "due"

    @admin.display(description="Latest start")
    def deadline_display(self, obj: Waiting) -> str:
        if obj.deadline is None:
            return "—"
        left = obj.deadline - timezone.now()
        return f"in {age(left)}" if left.total_seconds() > 0 else "passed (expiring)"

    @admin.display(description="State")
    def state_display(self, obj: Waiting) -> str:
        if obj.shadow:
            return "duplicate"
        if obj.group_blocked:
            return "blocked by group"
        if obj.not_before is not None and obj.debounce_cap is not None and obj.not_before > timezone.now():
            return "debounced"  # issue 14 item 2: waits out its key's quiet period (at most until debounce_cap)
        if obj.not_before is not None:
            return "not due"
        return "in line"

    @admin.action(description="Cancel (revoke) the selected tasks…", permissions=["cancel_waiting"])
    def cancel_action(self, request: HttpRequest, queryset: QuerySet[Waiting]) -> HttpResponse | None:
        rows = list(queryset.order_by("arrival"))
        form = ReasonForm(request.POST if request.POST.get("post") == "yes" else None)
        if request.POST.get("post") == "yes" and form.is_valid():
            ledger = ledger_access.get_ledger()
            promotions: list[Any] = []
            task_ids = sorted({r.task_id for r in rows if not r.shadow})
            for task_id in task_ids:
                promotions += ledger.revoke(task_id)
            started = ledger_access.dispatch(promotions)
            messages.success(request, f"Cancelled {len(task_ids)} waiting task{'s' if len(task_ids) != 1 else ''}: "
                                      f"booked revoked ({form.cleaned_data['reason']}).")
            log_action(request, [r for r in rows if not r.shadow], CHANGE,
                       f"Cancelled (revoked): {form.cleaned_data['reason']}")
            if any(r.shadow for r in rows):
                messages.info(request, "Duplicates (shadows) were left alone: they follow their running attempt.")
            if promotions:
                messages.info(request, _promotions_text(promotions, started))
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": "Cancel waiting tasks?",
            "opts": self.model._meta,
            "rows": rows,
            "form": form,
            "action": "cancel_action",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, f"admin/{APP}/waiting/cancel.html", context)


# -- outcomes and explain --------------------------------------------------------------------------------------------


class OutcomeFilter(admin.SimpleListFilter):
    title = "outcome"
    parameter_name = "outcome"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("open", "still waiting or running"), *OUTCOMES]

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
class TaskRecordAdmin(ReadOnlyAdmin):
    list_display = ("task_link", "task_name", "key", "group_key", "outcome_display", "arrived_display",
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

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        context = {"explain_url": _url("explain"), **(extra_context or {})}
        return super().changelist_view(request, extra_context=context)

    @admin.display(description="Task", ordering="task_id")
    def task_link(self, obj: TaskRecord) -> str:
        return explain_link(obj.task_id)

    @admin.display(description="Outcome", ordering="outcome")
    def outcome_display(self, obj: TaskRecord) -> str:
        if obj.outcome is None:
            return format_html("<em>{}</em>", "in progress")
        colour = "#2a7d2a" if obj.outcome == "completed" else "#ba2121"
        return format_html('<span style="color:{}">{}</span>', colour, obj.get_outcome_display())

    @admin.display(description="Arrived", ordering="arrived_at")
    def arrived_display(self, obj: TaskRecord) -> str:
        return format_html('<span title="{}">{} ago</span>', obj.arrived_at.isoformat(), since(obj.arrived_at))

    @admin.display(description="Took", ordering="finished_at")
    def took_display(self, obj: TaskRecord) -> str:
        if obj.finished_at is None:
            return "—"
        return age(obj.finished_at - obj.arrived_at)

    @admin.display(description="Attempts")
    def attempts_display(self, obj: TaskRecord) -> str:
        return str(obj.finished_attempt + 1) if obj.finished_attempt >= 0 else "—"

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


@admin.register(Event)
class EventAdmin(ReadOnlyAdmin):
    list_display = ("at", "kind_display", "key", "task_display", "detail")
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



# -- workers and their configuration versions (issue 14 item 7) ----------------------------------------------------


@admin.register(Holder)
class HolderAdmin(ReadOnlyAdmin):
    list_display = ("hostname", "pid", "started_at", "latest_display", "config_version_display", "claims_display")
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


# -- refusal at send (issue 14 item 3) ---------------------------------------------------------------------------


@admin.register(Sent)
class SentAdmin(ReadOnlyAdmin):
    list_display = ("task_display", "key", "dedupe_key", "sent_at", "expires_at")
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


# -- the outbox (issue 14 item 8) --------------------------------------------------------------------------------


@admin.register(Outbox)
class OutboxAdmin(ReadOnlyAdmin):
    list_display = ("task_display", "task_name", "key", "group_key", "registered_at", "state_display", "due_at")
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


# Weighted fair sharing (issue 14 item 5): fair weight overrides and their audit trail, registered from their module.
# A key that throttles itself (issue 14 item 4): per-key pauses and limits, registered from their module.
from celery_keyed_django import fair_weights_admin, key_overrides_admin  # noqa: E402, F401
