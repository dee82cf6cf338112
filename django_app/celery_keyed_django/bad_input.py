"""Requests the admin answers 400 Bad Request before any query runs: a NUL character anywhere in the query string, the
form or the URL (PostgreSQL's text refuses it: ``?state=%00`` was a ``DataError`` and a 500), and a selection of rows
(``_selected_action``) that is not ids of the list's rows (``abc`` for a claim's fence was a 500)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.contrib.admin import helpers
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.urls import URLPattern


def bad_input(model: Any, request: HttpRequest, url_arguments: dict[str, Any]) -> str | None:
    """What is wrong with a request to an admin page of ``model``, or None."""
    fields = [*request.GET.lists(), *(request.POST.lists() if request.method == "POST" else [])]
    for name, values in fields:
        if any("\x00" in text for text in (name, *values)):
            return f"the parameter {name!r:.60} contains a NUL character"
    for name, value in url_arguments.items():
        if isinstance(value, str) and "\x00" in value:
            return f"the {name} in the address contains a NUL character"
    if request.method == "POST":
        pk = model._meta.pk
        for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
            try:
                pk.to_python(value)
            except ValidationError:
                return f"the selection names {value!r:.60}, which is not the id of a row of this list"
    return None


def _refusing(model: Any, view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    if getattr(view, "keyed_refuses_bad_input", False):
        return view

    @functools.wraps(view)
    def refusing_bad_input(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        problem = bad_input(model, request, kwargs)
        if problem is not None:
            return HttpResponseBadRequest(f"Bad request: {problem}.", content_type="text/plain; charset=utf-8")
        return view(request, *args, **kwargs)

    refusing_bad_input.keyed_refuses_bad_input = True  # type: ignore[attr-defined]
    return refusing_bad_input


class RefusesBadInput:
    """Mixin for a ``ModelAdmin``: every page it serves (Django's and its own, from ``get_urls``) refuses bad input
    with a 400 before its view runs."""

    model: Any

    @property
    def urls(self) -> list[Any]:
        patterns = self.get_urls()  # type: ignore[attr-defined]
        for pattern in patterns:
            if isinstance(pattern, URLPattern):
                pattern.callback = _refusing(self.model, pattern.callback)
        return patterns
