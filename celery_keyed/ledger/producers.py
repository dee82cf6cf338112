"""The producers' calls: what a producer asks the ledger before or while it publishes — refusal at send (a place in
a key's waiting room reserved before the publish, ``sent``), the outbox (a message stored, committed, before it is
published; a retry registered before it is published, ``outbox``) — and their counts for operators.

:class:`ProducerCalls` is the part of the ``Ledger`` facade that holds them: a ``session.LedgerSession`` with one
method per call, each one self-committing statement or one transaction.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery_keyed.ledger.migrations import schema_required
from celery_keyed.ledger.outbox import (
    OutboxCounts,
    OutboxDue,
    outbox_by_name,
    outbox_register,
    outbox_register_retry,
    outbox_take_due,
)
from celery_keyed.ledger.sent import SendCounts, SendVerdict, sent_admit, sent_by_name, sent_forget
from celery_keyed.ledger.session import LedgerSession


class ProducerCalls(LedgerSession):
    """A ledger session with the producers' calls (see the module docstring)."""

    def admit_at_send(
        self,
        task_id: str,
        key: str,
        *,
        dedupe_key: str | None = None,
        arrival_timeout: float = 3600.0,
        now: datetime | None = None,
    ) -> SendVerdict:
        """Refusal at send: one self-committing call of ``keyed_admit_at_send`` before a producer
        publishes ``task_id`` under ``key`` (its first concurrency key). Accepted: the task id's place in the key's
        waiting room (and its dedupe key) is reserved. Refused (``room_full``: the waiting room plus the sends
        not parked yet reach ``max_waiting``; ``duplicate``: the dedupe key is live in another task): nothing is
        reserved or booked. Decided inside Postgres under locks, so concurrent senders never over-fill the room
        (see ``ledger/sent.py``)."""
        with schema_required(self.engine):
            return self.autocommitted(
                lambda conn: sent_admit(
                    conn, task_id, key, dedupe_key=dedupe_key, arrival_timeout=arrival_timeout, now=now
                )
            )

    def forget_send(self, task_id: str) -> None:
        """Give back the place of a send accepted but never published (its publish raised)."""
        self.transaction(lambda conn: sent_forget(conn, task_id))

    def sends(self, *, now: datetime | None = None) -> list[SendCounts]:
        """Per name: sends accepted and not arrived yet, and the sends refused (room full, duplicate)."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return sent_by_name(conn, now=now)

    def register_at_publish(
        self,
        task_id: str,
        message: dict[str, Any],
        *,
        task_name: str = "",
        key: str | None = None,
        group_key: str | None = None,
        eta: datetime | None = None,
        arrival_timeout: float = 3600.0,
        now: datetime | None = None,
    ) -> bool:
        """The outbox: store ``task_id``'s message, committed when this returns, before the
        producer publishes it — one self-committing INSERT, one round trip. True when stored; False when the task id
        had already arrived or was registered (``ledger/outbox.py``)."""
        with schema_required(self.engine):
            return self.autocommitted(
                lambda conn: outbox_register(
                    conn, task_id, message, task_name=task_name, key=key, group_key=group_key, eta=eta,
                    arrival_timeout=arrival_timeout, now=now,
                )
            )

    def register_retry(
        self,
        task_id: str,
        attempt: int,
        message: dict[str, Any] | None,
        *,
        task_name: str = "",
        key: str | None = None,
        group_key: str | None = None,
        eta: datetime | None = None,
        arrival_timeout: float = 3600.0,
        now: datetime | None = None,
    ) -> bool:
        """Register retry number ``attempt`` of ``task_id`` before it is published, committed when this returns:
        with its ``message`` (the outbox is on: the relay publishes it again if the attempt does not arrive in
        time), or None (reconcile reports it). True when stored (``outbox.outbox_register_retry``)."""
        with schema_required(self.engine):
            return self.autocommitted(
                lambda conn: outbox_register_retry(
                    conn, task_id, attempt, message, task_name=task_name, key=key, group_key=group_key, eta=eta,
                    arrival_timeout=arrival_timeout, now=now,
                )
            )

    def outbox_due(
        self,
        *,
        arrival_timeout: float,
        grouped_timeout: float | None = None,
        batch: int = 100,
        now: datetime | None = None,
    ) -> list[OutboxDue]:
        """Take the registrations no worker received in time (and those registered in a caller's transaction,
        not published yet), committed, for the caller to publish (``outbox.outbox_take_due``)."""
        return self.transaction(
            lambda conn: outbox_take_due(
                conn, arrival_timeout=arrival_timeout, grouped_timeout=grouped_timeout, batch=batch, now=now
            )
        )

    def outbox(self) -> list[OutboxCounts]:
        """Per name: registrations not received yet, and how often the relay published them again."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return outbox_by_name(conn)
