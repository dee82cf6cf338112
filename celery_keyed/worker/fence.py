"""Self-fencing (D7, D19): an attempt whose lease may have lapsed is stopped, by a timer that never waits on the
database; and an attempt stopped that way is admitted again.

The deadline. The ledger counts a claim's lease from the database clock of the transaction that last set it (the
claim, then each renewal). ``Running.lease_from`` is a monotonic time taken before that transaction was *sent*, so
the lease cannot lapse before ``lease_from + keyed_lease``; the heartbeat moves it to the send time of each renewal
that succeeded (a renewal that took d seconds does not move it d seconds too far). ``SelfFence`` has a thread of its
own that wakes at the earliest ``lease_from + lease - self_fence_margin`` and stops every attempt past it, whatever
the heartbeat is doing: failing with any error (unreachable, a pool checkout timeout, a bug), or blocked in a
renewal on a connection whose server went silent. It reads only memory; it never calls the ledger.

Re-admission. A body the fence killed did nothing wrong, so it runs again whatever the task's acks settings
(``readmit_fenced``, from the request's failure hook): the attempt ends as "worker lost" (the ledger keeps the task
open; a copy of the attempt that arrives is admitted again, or kept as the shadow of its claim until that claim is
released or reclaimed, D8), and its message goes back to the broker — rejected with requeue when it is still
unacked (``acks_late``), else published again as it was received. The broker, not the ledger, takes it back: the
fence fires mostly when the ledger cannot be reached, and the copy must be safe before the ledger is back.

Threads and fields: ``SelfFence`` owns its thread; it reads the running table through ``running`` (a snapshot taken
under the gate's lock) and acts through ``terminate`` (the heartbeat's: SIGKILL of the pool process on prefork).
``Running.fenced`` is set once the fence acted on the attempt; ``Running.lease_from`` is written by the admitting
thread (once) and the heartbeat, read here (one float store each).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from billiard.einfo import ExceptionInfo, ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.exceptions import Reject

from celery_keyed.messages import republish_received

if TYPE_CHECKING:
    from celery_keyed.ledger import Token
    from celery_keyed.worker.running import Running

logger = logging.getLogger("celery_keyed")



@dataclass
class FenceReport:
    """What one ``fence_once`` did: the attempts it stopped, and the next deadline it waits for (None: none)."""

    fenced: list[Token] = field(default_factory=list)
    next_deadline: float | None = None


class SelfFence:
    """The self-fence of one gate. ``fence_once`` is one look, in the caller's thread; ``start`` / ``stop`` are
    safe to call twice.

    ``running``: the attempts this process tracks (a snapshot); ``terminate(entry, why)``: stop one, True once it
    acted (False: it cannot yet, e.g. no pool process took the request; asked again at the next look)."""

    def __init__(
        self,
        *,
        lease: float,
        margin: float,
        interval: float,
        running: Callable[[], list[Running]],
        terminate: Callable[[Running, str], bool],
    ) -> None:
        if not 0 <= margin < lease:
            raise ValueError(f"the self-fence margin ({margin}) must be below the lease ({lease})")
        self.lease = lease
        self.margin = margin
        self.interval = interval
        self.running = running
        self.terminate = terminate
        self._exit = threading.Event()
        self._thread: threading.Thread | None = None

    def deadline(self, entry: Running) -> float:
        """The monotonic time from which ``entry`` may have lost its slot, less the margin."""
        return entry.lease_from + self.lease - self.margin

    def fence_once(self, now: float | None = None) -> FenceReport:
        """Stop every attempt past its deadline at ``now`` (monotonic; default: the clock). Memory only."""
        moment = time.monotonic() if now is None else now
        report = FenceReport()
        for entry in self.running():
            if entry.fenced:
                continue
            deadline = self.deadline(entry)
            if moment < deadline:
                if report.next_deadline is None or deadline < report.next_deadline:
                    report.next_deadline = deadline
                continue
            why = (
                f"no lease renewal succeeded for {moment - entry.lease_from:.1f}s (lease {self.lease:g}s,"
                f" margin {self.margin:g}s): the ledger did not answer"
            )
            if self.terminate(entry, why):
                report.fenced.append(entry.token)
        return report

    def start(self) -> None:
        """Start the thread unless it runs."""
        if self._thread is None or not self._thread.is_alive():
            self._exit.clear()
            self._thread = threading.Thread(target=self._run, name="keyed-self-fence", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._exit.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)

    def _run(self) -> None:
        while not self._exit.is_set():
            try:
                report = self.fence_once()
            except Exception:
                logger.exception("celery-keyed: the self-fence failed")
                report = FenceReport()
            wait = self.interval
            if report.next_deadline is not None:
                wait = min(wait, report.next_deadline - time.monotonic())
            self._exit.wait(max(wait, 0.005))


def fenced_kill(exc_info: Any) -> bool:
    """Whether a failure is the end of a body the fence killed (its pool process lost), not its own outcome."""
    exc = getattr(exc_info, "exception", None)
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    return isinstance(exc, WorkerLostError | SystemExit | KeyboardInterrupt)


def readmit_fenced(app: Any, request: Any, exc_info: Any) -> Any:
    """The failure hook of a request whose body the self-fence killed: the ``exc_info`` Celery is to handle. A
    ``Reject(requeue=True)``: Celery stores no result, sends no failure, and puts an unacked message back in the
    broker; an acked one (``acks_late`` off) is published again here first. The release books the attempt as "worker
    lost" (``request.failure_outcome``), and the copy is admitted again (D8, D19). A body that ended otherwise
    (its own result came first), or a copy that could not be sent, keeps its ``exc_info``."""
    if not fenced_kill(exc_info):
        return exc_info
    if request.acknowledged:
        try:
            republish_received(app, request)
        except Exception:
            logger.exception(
                "celery-keyed: %s[%s] was stopped to keep the bound, and could not be sent again: it fails",
                request.name,
                request.id,
            )
            return exc_info
    logger.warning(
        "celery-keyed: %s[%s] was stopped to keep the bound; it goes back to the broker to be admitted again",
        request.name,
        request.id,
    )
    try:
        raise Reject(f"stopped by the self-fence: {request.keyed_fenced}", requeue=True)
    except Reject:
        return ExceptionInfo()
