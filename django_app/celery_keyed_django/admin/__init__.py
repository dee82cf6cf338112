"""The operators' console in Django admin, one module per thing an operator does:

- ``overview``: the app's landing page — every name with in flight / limit, waiting, the oldest wait, pauses,
  rejections and expiries of the last hour, drift repaired by reconcile — then the pages grouped;
- live state: ``keys`` (the live view), ``claims`` (held slots; force release), ``waiting`` (parked tasks; cancel),
  ``workers`` (worker processes, accepted sends, the outbox), ``groups`` (held groups; resume, skip the head);
- limits: ``limits`` (name overrides, configured names), ``key_limits`` (a key's pause or own limit),
  ``fair_weights`` (fair weight overrides);
- history: ``history`` (task outcomes, the audit trails, ledger events) and ``explain`` (why a task is (not) running).

``base`` and ``rendering`` hold what the pages share. Every screen reads through the read-only models; every change
goes through the ledger's functions (set_override, clear_override, the fenced release, revoke...), which keep the
counters, the audit trail and the promotions right, and then the promotions they made are dispatched
(``celery_keyed_django.ledger.dispatch``). Importing this package registers every page with ``admin.site``.
"""

from __future__ import annotations

from celery_keyed_django.admin import (  # noqa: F401  (each module registers its pages)
    claims,
    fair_weights,
    groups,
    history,
    key_limits,
    keys,
    limits,
    waiting,
    workers,
)
from celery_keyed_django.admin.base import _key_limit_and_source, _limit_and_source
from celery_keyed_django.admin.rendering import _promotions_text

__all__ = ["_key_limit_and_source", "_limit_and_source", "_promotions_text"]
