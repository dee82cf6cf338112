"""The verdicts: what becomes of a keyed request that does not run here — parked (acked: the ledger holds its
message now), a duplicate delivery dropped, or a final outcome without a run (rejected, expired, dead-lettered...)
recorded, its failure result stored and announced. Any thread that acts on an admission (the consumer loop,
mostly); never raises into it (D16).

Collaborators, given by the gate: the app (its result backend), the ledger, the releaser (a parked key is
contended), the sweeper (results of superseded tasks) and the announcements (``announce_parked``,
``announce_never_ran``). No state of its own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from celery.worker import state as worker_state

from celery_keyed import exceptions, metrics
from celery_keyed.ledger import LedgerError, Verdict

logger = logging.getLogger("celery_keyed")


class Verdicts:
    """The verdicts of one worker process."""

    def __init__(
        self,
        *,
        app: Any,
        ledger: Any,
        releaser: Any,
        sweeper: Any,
        announce_parked: Callable[[str, str, str | None], None],
        announce_never_ran: Callable[[str, str, str, str, str | None], None],
        journal_parked: Callable[[Any], None] = lambda request: None,
    ) -> None:
        self.journal_parked = journal_parked  # the failover watch: published again if a failover loses its row (D20)
        self.app = app
        self.ledger = ledger
        self.releaser = releaser
        self.sweeper = sweeper
        self._announce_parked = announce_parked
        self.announce_never_ran = announce_never_ran

    def _not_admitted(self, request: Any, admission: Any) -> None:
        metrics.debounced(admission)
        if admission.verdict is Verdict.PARKED:
            key = request.keyed_arrival_key
            self.releaser.mark_contended(key)
            request.acknowledge()  # the parked row is committed: the ledger holds the message now
            self.journal_parked(request)
            worker_state.task_ready(request)
            self._announce_parked(request.id, request.name, key)
            if admission.superseded:  # stored from their books rows (their stored messages: their errbacks)
                with contextlib.suppress(sa.exc.SQLAlchemyError, LedgerError):
                    self.sweeper.notify_never_ran(list(admission.superseded))
        elif admission.verdict is Verdict.DUPLICATE:
            logger.info(
                "celery-keyed: duplicate delivery of %s[%s] dropped (%s)", request.name, request.id, admission.detail
            )
            request.acknowledge()
            worker_state.task_ready(request)
        else:
            self._finish_without_running(request, admission.verdict.value, admission.detail)

    def refuse_malformed(self, task_id: str, task_name: str, detail: str, task: Any) -> None:
        """A keyed message Celery could not even build a request from (``KeyedRequest``): recorded as rejected, its
        ``KeyedRejected`` result stored, announced. Celery's consumer then rejects the message. Never raises."""
        logger.error("celery-keyed: %s[%s] rejected: %s", task_name, task_id[:300], detail)
        with contextlib.suppress(sa.exc.SQLAlchemyError, LedgerError):
            self.ledger.reject_unkeyable(task_id, task_name=task_name, detail=detail)

        def store() -> None:
            backend = task.backend if task is not None else self.app.backend
            backend.mark_as_failure(task_id, exceptions.KeyedRejected(detail), store_result=True)

        if self._store_once(task_id, "rejected", store):
            with contextlib.suppress(Exception):
                self.announce_never_ran(task_id, "rejected", detail, task_name, None)

    def _finish_without_running(
        self, request: Any, outcome: str, detail: str, *, record_in_ledger: bool = False
    ) -> None:
        """Record (when asked), store the failure result, ack. Never raises: it runs on the consumer loop for
        hostile messages too (D16). A result that could not be stored is stored later from the books (the
        row stays unnotified and the sweeper retries it)."""
        if record_in_ledger:
            with contextlib.suppress(sa.exc.SQLAlchemyError, LedgerError):
                self.ledger.reject_unkeyable(request.id, task_name=request.name, detail=detail)
        logger.warning("celery-keyed: %s[%s] %s: %s", request.name, request.id, outcome, detail)

        def store() -> None:
            exc = exceptions.BY_OUTCOME[outcome](detail)
            request.task.backend.mark_as_failure(request.id, exc, request=request._context, store_result=True)

        stored = self._store_once(request.id, outcome, store)
        request.acknowledge()
        worker_state.task_ready(request)
        if stored:
            self.announce_never_ran(
                request.id, outcome, detail, request.name, getattr(request, "keyed_arrival_key", None)
            )

    def _store_once(self, task_id: str, outcome: str, store: Callable[[], None]) -> bool:
        """Store the result of a task this worker refused, with the request's context, unless another notifier
        holds its books row or has stored it (``Ledger.take_never_ran``: one result, one errback). A task id the
        books do not know is stored here (nobody else will); with the ledger out of reach too, at the risk of a
        second store by a sweep later. True when this call stored it."""
        state = {"tried": False, "stored": False}

        def attempt() -> bool:
            state["tried"] = True
            try:
                store()
            except Exception:
                logger.exception("celery-keyed: could not store the %s result of %s", outcome, task_id[:300])
                return False
            state["stored"] = True
            return True

        try:
            with self.ledger.take_never_ran([task_id]) as taken:
                if taken.rows and attempt():
                    taken.stored(task_id)
                elif not taken.rows and task_id in taken.unknown:
                    attempt()
        except (sa.exc.SQLAlchemyError, LedgerError):
            if not state["tried"]:
                attempt()
        return state["stored"]
