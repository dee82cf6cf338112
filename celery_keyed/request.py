"""The worker-side request of a keyed task: admission when the pool can start it (D3), release on every
outcome from the main process (§3.3).

Celery generates a request class per task (``create_request_cls``) that defines its own
``execute_using_pool`` and ``on_success`` and never calls ``super()``; a subclass method would be shadowed. So
``KeyedRequest.__init__`` wraps those methods **per instance** (an instance attribute wins over the class).
A request whose call carries no key is left completely alone: Celery's own path, no database call.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.exceptions import Ignore, InvalidTaskError, Reject, Retry, Terminated, TimeLimitExceeded
from celery.worker.request import Request

from celery_keyed.ledger import Outcome
from celery_keyed.worker.fence import readmit_fenced

logger = logging.getLogger("celery_keyed")


class KeyedRequest(Request):
    """Request of a :class:`~celery_keyed.task.KeyedTask`. Its keyed state lives in ``keyed_claim``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except MALFORMED as exc:
            # Celery's own constructor unpacks the body ([args, kwargs, embed]) and reads the headers: a foreign
            # message shaped otherwise raised out of the strategy, killing the worker ("Unrecoverable error"), and
            # the message, restored unacked, then killed the next worker too. As Celery does for an ETA it cannot
            # parse: an invalid task message, which its consumer logs and rejects (dropped); first its result is
            # a KeyedRejected failure and the books record the rejection (D16), so no caller waits for ever.
            refuse_malformed(args, kwargs, exc)
            raise InvalidTaskError(f"malformed task message: {type(exc).__name__}: {exc}") from exc
        if not isinstance(self.id, str) or not self.id:  # the strategy looks it up in a set next (a list: TypeError)
            bad_id = TypeError(f"the task id must be a non-empty str, got {self.id!r}"[:300])
            refuse_malformed(args, kwargs, bad_id)
            raise InvalidTaskError(f"malformed task message: {bad_id}")
        self.keyed_claim: Any = None  # (Token, fence) while this request holds a slot
        self.keyed_arrival_key: str | None = None  # its concurrency key, once admission computed it
        self.keyed_arrival: Any = None  # its ledger Arrival, when computed at receipt (a claim taken ahead)
        self.keyed_started = False
        self.keyed_defer_ack = False  # inside an outcome hook: an ack waits for the release (D15)
        self.keyed_deferred_ack: Any = None  # the ack Celery asked for meanwhile
        self.keyed_receipt = False  # handed to the admission service at receipt (park at receipt), not back yet
        self.keyed_cancelled: str | None = None  # newest wins: a newer arrival's cancel reached it (its detail)
        self.keyed_fenced: str | None = None  # the self-fence killed its body (why): it is admitted again (D19)
        self.keyed_exit_held = False  # its release waits for its pool process's exit (a hard time limit, D17)
        from celery_keyed.gate import current_gate

        gate = current_gate()
        if gate is None:
            return  # not in a worker with the gate (e.g. eager or a worker without install())
        if not gate.is_keyed(self):
            return
        cls: Any = type(self)
        original_execute = cls.execute_using_pool
        original_success = cls.on_success
        original_failure = cls.on_failure
        original_timeout = cls.on_timeout
        original_accepted = cls.on_accepted
        original_cancel = cls.cancel
        original_acknowledge = cls.acknowledge

        def execute_using_pool(pool: Any, **kw: Any) -> Any:
            return gate.execute(self, lambda: original_execute(self, pool, **kw))

        def acknowledge() -> Any:
            # D15: an acks_late task is acked by its outcome hook; while it holds a claim, that ack waits until
            # the release has committed, so a worker that dies in between leaves the message to be redelivered
            # (and dropped by the ledger as finished) instead of an acked task whose outcome was never booked.
            if self.keyed_defer_ack and self.keyed_claim is not None:
                if self.keyed_deferred_ack is not None:  # one waits already (a hard time limit acks in two hooks,
                    return None  # and its release waits for the pool process's exit)
                # Meanwhile the pool process is free: the unacked message must not keep the next one away, so
                # the prefetch window opens by one until this ack is sent (as Celery does for an ETA task).
                narrow = gate.widen_prefetch()

                def deferred() -> Any:
                    try:
                        return original_acknowledge(self)
                    finally:
                        narrow()

                self.keyed_deferred_ack = deferred
                return None
            return original_acknowledge(self)

        def deferring_acks(hook: Any) -> Any:
            outer = self.keyed_defer_ack
            self.keyed_defer_ack = True
            try:
                return hook()
            finally:
                self.keyed_defer_ack = outer

        def on_success(failed__retval__runtime: Any, **kw: Any) -> Any:
            result = deferring_acks(lambda: original_success(self, failed__retval__runtime, **kw))
            if not failed__retval__runtime[0]:  # a failure went through on_failure (our wrapper)
                gate.release(self, Outcome.COMPLETED)
            return result

        def on_failure(exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
            uncertain = is_uncertain(exc_info)  # read before a substitution: a killed body's call may still run
            if self.keyed_cancelled is not None:  # newest wins: the attempt ended because a newer call cancelled it
                exc_info = superseded_info(self.keyed_cancelled, exc_info)
            elif self.keyed_fenced is not None:  # killed to keep the bound: back to the broker, admitted again
                exc_info = readmit_fenced(gate.app, self, exc_info)
            try:
                return deferring_acks(
                    lambda: original_failure(self, exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
                )
            finally:
                outcome = failure_outcome(self, exc_info)
                if is_hard_time_limit(exc_info):  # failed before its pool process is killed: wait for the exit
                    release_after_exit(gate, self, outcome)
                else:
                    detail = store_cancelled(self) if cancelled_for_good(self, exc_info) else ""
                    gate.release(self, outcome, uncertain=uncertain, detail=detail)

        def on_timeout(soft: bool, timeout: float) -> Any:
            result = deferring_acks(lambda: original_timeout(self, soft, timeout))
            if not soft:  # a hard limit (on_failure fires too, first: the release is held once, idempotent)
                release_after_exit(gate, self, hard_timeout_outcome(self))
            return result

        def on_accepted(pid: int, time_accepted: float) -> Any:
            self.keyed_started = True
            return original_accepted(self, pid, time_accepted)

        def cancel(pool: Any, signal: Any = None, emit_retry: bool = True) -> Any:
            # Cold shutdown, or a lost broker connection (worker_cancel_long_running_tasks_on_connection_loss): Celery
            # only *sends* SIGTERM to the pool process here, and a body that handles it runs on. The slot stays held
            # (D17): billiard reports the job when the process has exited (``Terminated``) or when the body has
            # returned its result, and that outcome hook releases. If the worker's main process ends before that
            # (a second SIGQUIT: hard shutdown; SIGKILL), the claim stays until its lease lapses and the reaper frees
            # it — later, never early.
            return original_cancel(self, pool, signal=signal, emit_retry=emit_retry)

        # Instance attributes shadow the generated class's methods (which Celery looks up at call time).
        for name, wrapper in (
            ("execute_using_pool", execute_using_pool),
            ("on_success", on_success),
            ("on_failure", on_failure),
            ("on_timeout", on_timeout),
            ("on_accepted", on_accepted),
            ("cancel", cancel),
            ("acknowledge", acknowledge),
        ):
            setattr(self, name, wrapper)

    def keyed_take_deferred_ack(self) -> Any:
        """The ack an outcome hook deferred until the release commits (D15), once; None when there is none."""
        ack, self.keyed_deferred_ack = self.keyed_deferred_ack, None
        return ack


#: What Celery's ``Request.__init__`` raises for a message not shaped as a task message (a body that is not
#: ``[args, kwargs, embed]``, headers of the wrong types). Its own ``InvalidTaskError`` (a bad ETA) passes through.
MALFORMED = (ValueError, TypeError, KeyError, IndexError, AttributeError)


def refuse_malformed(args: tuple[Any, ...], kwargs: dict[str, Any], exc: BaseException) -> None:
    """Record a malformed keyed message as rejected and store its ``KeyedRejected`` result, when it carries a task
    id (a str) to store them under. Never raises: it runs in Celery's strategy, on the consumer loop."""
    from celery_keyed.gate import current_gate

    message = args[0] if args else kwargs.get("message")
    headers = kwargs.get("headers") or getattr(message, "headers", None) or {}
    task_id = headers.get("id") if isinstance(headers, dict) else None
    task = kwargs.get("task")
    gate = current_gate()
    detail = f"malformed task message: {type(exc).__name__}: {str(exc)[:300]}"
    if gate is None or not isinstance(task_id, str) or not task_id:
        logger.error("celery-keyed: %s (no task id to record it under)", detail)
        return
    gate.refuse_malformed(task_id, getattr(task, "name", "") or str(headers.get("task") or ""), detail, task)


def superseded_info(detail: str, exc_info: Any) -> Any:
    """Newest wins: the failure of an attempt a newer call cancelled, as Celery is to record it — a ``KeyedSuperseded``
    failure (its pool process terminated, ``Terminated``; or whatever the body raised once it saw
    ``keyed_cancelled()``), so Celery stores that result and acks the message instead of announcing a revoke (a
    REVOKED result, which callers waiting in ``get()`` would see first)."""
    from celery_keyed.exceptions import KeyedSuperseded

    exc = getattr(exc_info, "exception", None)
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    if isinstance(exc, KeyedSuperseded):
        return exc_info
    try:
        raise KeyedSuperseded(detail) from None
    except KeyedSuperseded:
        return ExceptionInfo()


def failure_outcome(request: Any, exc_info: Any) -> Outcome:
    """What an ``on_failure`` means for the attempt: will the task come back (retry / redelivery), or not."""
    exc = getattr(exc_info, "exception", None)
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    task = request.task
    if isinstance(exc, Retry):
        return Outcome.RETRY
    if isinstance(exc, Terminated):
        if not getattr(request, "_already_cancelled", False):
            return Outcome.REVOKED
        return Outcome.WORKER_LOST if comes_back(request) else Outcome.FAILED
    if isinstance(exc, SystemExit | KeyboardInterrupt):
        if getattr(request, "_already_cancelled", False) and not comes_back(request):
            return Outcome.FAILED
        return Outcome.WORKER_LOST
    if isinstance(exc, Reject):
        return Outcome.WORKER_LOST if exc.requeue else Outcome.FAILED
    if isinstance(exc, Ignore):
        return Outcome.COMPLETED
    if isinstance(exc, WorkerLostError):
        if task.acks_late and task.reject_on_worker_lost:
            return Outcome.WORKER_LOST
        if getattr(task, "retry_on_worker_lost", False):
            return Outcome.RETRY
        return Outcome.FAILED
    if isinstance(exc, TimeLimitExceeded):
        return hard_timeout_outcome(request)
    return Outcome.FAILED


def comes_back(request: Any) -> bool:
    """Whether the message of a request Celery cancelled comes back to a worker: an ``acks_late`` task not acked yet
    stays unacked (Celery neither acks nor rejects a cancelled task), and the broker delivers it again once the
    connection is gone. A task acked when it started (``acks_late`` off) is gone for good."""
    return bool(request.task.acks_late) and not getattr(request, "acknowledged", False)


def _exception(exc_info: Any) -> Any:
    exc = getattr(exc_info, "exception", None)
    return exc.exc if isinstance(exc, ExceptionWithTraceback) else exc


def cancelled_for_good(request: Any, exc_info: Any) -> bool:
    """Celery cancelled the task (cold shutdown, connection loss), its body has stopped without a result of its own,
    and its message does not come back. Celery leaves its result at RETRY ("cancelled by Celery") for ever."""
    return (
        getattr(request, "_already_cancelled", False)
        and isinstance(_exception(exc_info), Terminated | SystemExit | KeyboardInterrupt)
        and not comes_back(request)
    )


def store_cancelled(request: Any) -> str:
    """Store the ``KeyedCancelled`` failure of a task cancelled for good (``cancelled_for_good``) through its result
    backend, before its release books it failed (D15: a result stored first is what reconcile settles from if the
    worker dies in between), so ``AsyncResult.get()``, chords and errbacks complete. Returns the detail to book with
    it. Never raises."""
    from celery_keyed.exceptions import KeyedCancelled

    detail = (
        "cancelled by the worker (cold shutdown or a lost broker connection) while it ran; acked when it started, "
        "its message does not come back"
    )
    logger.warning("celery-keyed: %s[%s] %s", request.name, request.id, detail)
    try:
        request.task.backend.mark_as_failure(
            request.id, KeyedCancelled(detail), request=request._context, store_result=request.store_errors
        )
    except Exception:
        logger.exception("celery-keyed: could not store the cancelled result of %s", request.id)
    return detail


def is_hard_time_limit(exc_info: Any) -> bool:
    """billiard reports a hard time limit as the job's ``TimeLimitExceeded`` failure *before* it kills the pool
    process (SIGTERM, then SIGKILL 0.1 s later): the body may still run."""
    return isinstance(_exception(exc_info), TimeLimitExceeded)


def release_after_exit(gate: Any, request: Any, outcome: Outcome) -> None:
    """Release ``request`` (uncertain: a hard time limit) once its pool process has exited (D17; the gate's
    ``ExitWatch``), or at once when there is none to wait for. Held once, however many hooks ask (a hard limit fires
    ``on_failure`` and ``on_timeout``)."""
    if request.keyed_claim is None or request.keyed_exit_held:
        return
    request.keyed_exit_held = True
    if not gate.exits.hold(
        getattr(request, "worker_pid", None), functools.partial(release_stopped, gate, request, outcome, on_loop=False)
    ):
        release_stopped(gate, request, outcome)


def release_stopped(gate: Any, request: Any, outcome: Outcome, *, on_loop: bool = True) -> None:
    """The release of an attempt cut off by a hard time limit, now that its pool process has exited. The body may
    have run to its end after all — billiard kills the process only after the job's failure was handled, and that
    handling can take long (a result backend being retried): then it stored its SUCCESS result after Celery's
    failure, and the books say completed too (nothing runs it again). Otherwise ``outcome``, uncertain (an
    uncertain hold may keep the slots); booked failed, its ``TimeLimitExceeded`` failure is stored first when no
    result is (a cold shutdown that came with the limit kept Celery from storing it, and its message, never acked,
    comes back only to be dropped as finished: its caller would wait for ever)."""
    status = stored_status(request)
    if status == "SUCCESS":
        logger.warning("celery-keyed: %s[%s] ran to its end after its hard time limit", request.name, request.id)
        gate.release(request, Outcome.COMPLETED, on_loop=on_loop)
        return
    if outcome is Outcome.FAILED and status is not None and status != "FAILURE":
        hard = (getattr(request, "time_limits", None) or (None,))[0]
        try:
            request.task.backend.mark_as_failure(
                request.id, TimeLimitExceeded(hard), request=request._context, store_result=request.store_errors
            )
        except Exception:
            logger.exception("celery-keyed: could not store the time limit failure of %s", request.id)
    gate.release(request, outcome, uncertain=True, on_loop=on_loop)


def stored_status(request: Any) -> str | None:
    """The state the task's result backend holds for it, read afresh (PENDING when none is stored); None when it
    cannot be read, or when the task stores no result."""
    if getattr(request.task, "ignore_result", False):
        return None
    try:
        meta = request.task.backend.get_task_meta(request.id, cache=False)
    except Exception:
        logger.warning("celery-keyed: could not read the result of %s", request.id, exc_info=True)
        return None
    return meta.get("status") if isinstance(meta, dict) else None


def is_uncertain(exc_info: Any) -> bool:
    """Whether the attempt was cut off while its remote call may still be running (a hard time limit, a pool
    process lost): an uncertain hold may then keep its slots (DESIGN §7.4)."""
    exc = getattr(exc_info, "exception", None)
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    return isinstance(exc, TimeLimitExceeded | WorkerLostError)


def hard_timeout_outcome(request: Any) -> Outcome:
    task = request.task
    if task.acks_late and not task.acks_on_timeout:
        return Outcome.WORKER_LOST  # the message is requeued: the same attempt comes back
    return Outcome.FAILED
