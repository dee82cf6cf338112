"""The three patterns of celery-keyed as the tasks of a small shop backend.

1. **Mutex per entity** — ``sync_account``: one sync per account at a time, accounts in parallel. ``account`` is
   not configured, and an unconfigured name is a mutex per key (K = 1).
2. **A gate on a shared resource** — ``call_partner_api``: never more than 10 calls in flight to the partner API,
   whichever tenant makes them (``api``: limit 10), and at most 3 for any one tenant (``tenant``: limit 3). Both
   keys are claimed together or not at all; the narrow key comes first (see README, "Composition").
3. **An ordered stream per group** — ``apply_order_event``: the events of one order apply strictly in order
   (``group_key``); when one fails and retries, the order's later events wait through its backoff, other orders
   go on.

``research`` is the eight-arrival fixture: a gate of 2 with a bounded waiting room (3 places, a latest start 6
units after arrival): the callers it cannot serve are told so (``KeyedRejected``, ``KeyedExpired``) instead of
waiting for ever.

Each task sleeps to stand for its work, and records its start and end (``observed``) for the demo.
"""

from __future__ import annotations

import time
from typing import Any

from django.conf import settings

from celery_keyed import keyed_task
from example_project.shop.observer import observed


class PaymentGatewayTimeout(Exception):
    """A transient failure: the order event is tried again after a backoff."""


@keyed_task(bind=True, name="shop.sync_account", concurrency_key="account:{account_id}")
def sync_account(self: Any, account_id: int, label: str = "", seconds: float = 0.5) -> str:
    """Sync one account with its remote system: one at a time per account, accounts in parallel."""
    with observed(self, f"account:{account_id}", label):
        time.sleep(seconds)
    return label


@keyed_task(bind=True, name="shop.call_partner_api", concurrency_key=["tenant:{tenant_id}", "api"])
def call_partner_api(self: Any, tenant_id: str, label: str = "", seconds: float = 0.5) -> str:
    """Call the partner API for a tenant: 10 calls in flight at most in all, 3 at most per tenant."""
    with observed(self, f"tenant:{tenant_id}", label):
        time.sleep(seconds)
    return label


@keyed_task(bind=True, name="shop.apply_order_event", group_key="order:{order_id}", max_retries=3)
def apply_order_event(
    self: Any, order_id: int, event: str, label: str = "", seconds: float = 0.5, fail_attempts: int = 0
) -> str:
    """Apply one event to an order, strictly in order per order. ``fail_attempts`` makes the first attempts fail
    with a transient error (the demo fails one payment once): the event retries after
    ``EXAMPLE_RETRY_BACKOFF`` seconds, and the order's later events wait for it."""
    with observed(self, f"order:{order_id}", label):
        time.sleep(seconds)
        if self.request.retries < fail_attempts:
            raise self.retry(exc=PaymentGatewayTimeout(event), countdown=settings.EXAMPLE_RETRY_BACKOFF)
    return label


@keyed_task(bind=True, name="shop.research", concurrency_key="research:{topic}")
def research(self: Any, topic: str, label: str = "", seconds: float = 2.0) -> str:
    """A slow research job: at most 2 per topic, 3 may wait, none starts later than 6 units after arrival."""
    with observed(self, f"research:{topic}", label):
        time.sleep(seconds)
    return label
