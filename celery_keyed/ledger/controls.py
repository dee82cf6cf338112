"""The operator's controls: audited runtime changes of limits and weights, and what is in force now — a name's
override (``overrides``), a key's own limit or pause (``key_overrides``), a fair name's weights by prefix
(``fair_weights``), a held group's resume or skip (``group_policies``). Each change is one transaction and returns
the promotions the room it made let in (D2).

:class:`OperatorControls` is the part of the ``Ledger`` facade that holds them: a ``session.LedgerSession`` with one
method per control, each forwarding to its table module's function.
"""

from __future__ import annotations

from datetime import datetime

from celery_keyed.ledger.attempts import Promotion
from celery_keyed.ledger.fair_weights import FairShare, clear_fair_weight, fair_shares, set_fair_weight
from celery_keyed.ledger.group_policies import (
    GroupAction,
    GroupHold,
    group_hold,
    held_groups,
    resume_group,
    skip_group_head,
)
from celery_keyed.ledger.key_overrides import (
    KeyOverride,
    clear_key_limit,
    key_override_get,
    pause_key,
    resume_key,
    set_key_limit,
)
from celery_keyed.ledger.migrations import schema_required
from celery_keyed.ledger.overrides import clear_override, set_override
from celery_keyed.ledger.session import LedgerSession


class OperatorControls(LedgerSession):
    """A ledger session with the operator's controls (see the module docstring)."""

    def set_override(
        self,
        name: str,
        limit: int,
        *,
        reason: str,
        author: str = "",
        expires_at: datetime | None = None,
        now: datetime | None = None,
    ) -> list[Promotion]:
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: set_override(
                    conn, name, limit, reason=reason, author=author, expires_at=expires_at, dispatch=self.dispatch,
                    now=now,
                )
            )

    def clear_override(
        self, name: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> list[Promotion]:
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: clear_override(conn, name, reason=reason, author=author, dispatch=self.dispatch, now=now)
            )

    def set_fair_weight(
        self,
        name: str,
        prefix: str,
        weight: float,
        *,
        reason: str,
        author: str = "",
        expires_at: datetime | None = None,
        now: datetime | None = None,
    ) -> None:
        """Set the runtime weight of the fair keys of ``name`` matching ``prefix`` (ledger/fair_weights.py), audited;
        it takes effect at the next promotion of each key (it makes no room, so it promotes nothing)."""
        with schema_required(self.engine):
            self.transaction(
                lambda conn: set_fair_weight(
                    conn, name, prefix, weight, reason=reason, author=author, expires_at=expires_at, now=now
                )
            )

    def clear_fair_weight(
        self, name: str, prefix: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> bool:
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: clear_fair_weight(conn, name, prefix, reason=reason, author=author, now=now)
            )

    def fair_shares(
        self, *, name: str | None = None, key: str | None = None, limit: int = 200, now: datetime | None = None
    ) -> list[FairShare]:
        with schema_required(self.engine), self.engine.connect() as conn:
            return fair_shares(conn, name=name, key=key, limit=limit, now=now)

    def set_key_limit(
        self,
        key: str,
        limit: int,
        *,
        reason: str,
        author: str = "",
        expires_at: datetime | None = None,
        expires_in: float | None = None,
        now: datetime | None = None,
    ) -> list[Promotion]:
        """Give ``key`` a limit of its own (its name's no longer applies to it) until ``expires_at`` / for
        ``expires_in`` seconds (neither: until cleared), audited; the promotions a raised limit made."""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: set_key_limit(
                    conn, key, limit, reason=reason, author=author, expires_at=expires_at, expires_in=expires_in,
                    dispatch=self.dispatch, now=now,
                )
            )

    def clear_key_limit(
        self, key: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> list[Promotion] | None:
        """Remove the key's own limit (its name's applies again); None when it had none."""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: clear_key_limit(conn, key, reason=reason, author=author, dispatch=self.dispatch, now=now)
            )

    def pause_key(
        self,
        key: str,
        seconds: float | None = None,
        *,
        until: datetime | None = None,
        reason: str,
        author: str = "",
        now: datetime | None = None,
    ) -> tuple[datetime, bool]:
        """Pause ``key`` (not its name) for ``seconds`` or until ``until``: nothing new of it starts before then,
        running attempts go on, its waiters keep their places. Only ever extends a pause. (End of the pause in force,
        whether this call set it.)"""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: pause_key(conn, key, seconds, until=until, reason=reason, author=author, now=now)
            )

    def resume_key(
        self, key: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> list[Promotion] | None:
        """End the pause of ``key`` now; its waiters are promoted (returned). None when it was not paused."""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: resume_key(conn, key, reason=reason, author=author, dispatch=self.dispatch, now=now)
            )

    def key_override(self, key: str, *, now: datetime | None = None) -> KeyOverride | None:
        """The override of ``key`` in force now (its own limit, its pause), or None."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return key_override_get(conn, key, now=now)


    def resume_group(
        self, group_key: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> GroupAction | None:
        """End the hold of a held group (its policy is ``hold`` and its head failed): its head — the failed task's
        retry, or the next number when the failed task ended for good — may start (the promotions are in the
        result). None when the group is not held (nothing changed). Recorded as a ``group_resumed`` event."""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: resume_group(
                    conn, group_key, reason=reason, author=author, dispatch=self.dispatch, now=now
                )
            )

    def skip_group_head(
        self, group_key: str, *, reason: str = "", author: str = "", now: datetime | None = None
    ) -> GroupAction | None:
        """Dead-letter the failed head of a held group (unless it ended already: ``skipped`` says) and end the hold:
        the next number may start (the promotions are in the result). None when the group is not held. Recorded as a
        ``group_head_skipped`` event."""
        with schema_required(self.engine):
            return self.transaction(
                lambda conn: skip_group_head(
                    conn, group_key, reason=reason, author=author, dispatch=self.dispatch, now=now
                )
            )

    def group_hold(self, group_key: str) -> GroupHold | None:
        """The hold of ``group_key`` (when, which head, why), or None when it is not held."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return group_hold(conn, group_key)

    def held_groups(self, *, limit: int = 100) -> list[GroupHold]:
        """The held groups, oldest hold first."""
        with schema_required(self.engine), self.engine.connect() as conn:
            return held_groups(conn, limit=limit)
