"""What the admin's pages stand on: the read-only base of the ledger's pages, the names configured anywhere, and a
name's (and a key's) limit and its source as the ledger decides them, one indexed lookup per shown row."""

from __future__ import annotations

from typing import Any, Literal

from django.contrib import admin
from django.db.models import CharField, F, Func, IntegerField, OuterRef, QuerySet, Subquery
from django.db.models.expressions import RawSQL
from django.http import HttpRequest, HttpResponse

from celery_keyed.ledger import limited_names_sql, name_limit_sql
from celery_keyed_django import ledger as ledger_access
from celery_keyed_django.admin.rendering import APP, _url
from celery_keyed_django.bad_input import RefusesBadInput
from celery_keyed_django.models import Name, TaskRecord

#: Seconds between reloads of the live pages (keys, claims, waiting tasks); paused while rows are selected.
AUTO_REFRESH_SECONDS = 10


def configured_names() -> set[str]:
    """Names configured in settings or synced to the ledger by a worker (keyed_names)."""
    return ledger_access.configured_names() | set(Name.objects.values_list("name", flat=True))


def _task_name() -> Subquery:
    """The task's name, from the books (one indexed lookup per shown row)."""
    return Subquery(TaskRecord.objects.filter(task_id=OuterRef("task_id")).values("task_name")[:1])


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
    (``key_paused``), else its own limit (``key``), else its name's override, else the limit its latest call
    computed (``call``), else its name's configured limit."""
    limit, source = _limit_and_source(obj)
    if limit == 0:
        return limit, source
    if obj.key_paused_until is not None:
        return 0, "key_paused"
    if obj.key_limit is not None:
        return obj.key_limit, "key"
    called = getattr(obj, "call_limit", None)
    if source != "override" and called is not None:
        return called, "call"
    return limit, source


def _override_link(name: str, has_override: bool) -> str:
    if has_override:
        return _url("override_change", name)
    return _url("override_add", query={"name": name})

