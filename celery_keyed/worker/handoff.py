"""Handoff and wake-up: how promotions start (D4, D5), and how the other threads hand work to the consumer loop.

A promotion is an attempt given a slot by the ledger (a release, a sweep, a reclaim, an admission that found
room for waiters ahead of it). ``route`` is the one dispatch policy: run it here from its stored message (local
handoff: this worker consumes its queue, on the consumer loop), hand it to the loop first (found off the loop),
or republish it with its nonce for any worker. A promotion bound to this worker in its releaser's transaction
(no nonce) waits in ``prebound`` until a pool process starts it; it is renewed by the heartbeat (D13),
confirmed by a guarded statement when it starts (D14, ``confirm_prebound``), and given back when it waited too
long or the worker shuts down (``give_back_prebound``).

The loop-calls pipe: kombu's channel and Celery's consumer belong to the loop thread, so other threads never
touch them. They append to ``_to_loop`` (promotions to start here) or ``_loop_calls`` (deferred broker acks,
admission verdicts, events) and write a byte to a pipe whose read end the loop's hub watches (``attach``); the
loop drains both when it wakes (``drain``). On a transport without a hub (polling), a short loop timer drains.

Threads and fields:

- ``prebound``: under ``lock`` (the gate's lock, shared with its running table so the heartbeat copies both at
  once); written by the loop (``run_here``, admission), the admission thread (``confirm_prebound``) and the
  heartbeat (lapsed or stale entries).
- ``_to_loop``, ``_loop_calls``: appended by any thread, popped by the loop only (deques: thread-safe ends).
- ``_waker``: (hub, read fd, write fd); set on the loop at every consumer start, read by any thread to wake
  the loop, closed at shutdown once the other threads are stopped.
- ``_handoff_strategies``: the loop's only.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state
from celery.worker.strategy import default as default_strategy

from celery_keyed.engine import UNREACHABLE
from celery_keyed.headers import HEADER_KEY
from celery_keyed.ledger import Outcome, Promotion, Token
from celery_keyed.messages import publish_promoted, restore_message
from celery_keyed.worker.poolline import join_line, pool_line, slot_holders_ahead  # noqa: F401 (re-exported)
from celery_keyed.worker.running import Prebound

logger = logging.getLogger("celery_keyed")


#: A promotion starts here, though every pool process has work that will run, when the first of them is expected to
#: be free within this many seconds: the typical run of an attempt here (``Handoff.note_run``) over the number of pool
#: processes. It goes ahead of the requests that hold no slot in the line for a process (``join_line``); published
#: instead, it would wait
#: behind whatever the broker's queue holds — in a burst, the whole burst.
SOON = 0.05

#: Weight of the latest run in the typical run (an exponentially weighted mean).
RUN_WEIGHT = 0.2


class Route(enum.Enum):
    """Where a promotion goes (``route``)."""

    RUN_HERE = "run here"  # on the consumer loop, from its stored message
    TO_LOOP = "to the loop"  # found off the loop: queued for the loop, which runs it here
    REPUBLISH = "republish"  # published with its nonce for any worker (or, bound here, back in line)


def route(
    promotion: Promotion,
    *,
    on_loop: bool,
    closed: bool,
    local_handoff: bool,
    consumes: bool,
    pool_has_room: bool,
    loop_runs: bool,
) -> Route:
    """The dispatch policy of promotions, in one place.

    - Shutting down (``closed``): this worker starts nothing new — republish.
    - A promotion with a nonce (not bound here yet) while the pool is busy: a busy pool would keep it waiting
      while other workers idle — republish for any worker.
    - Local handoff off (``keyed_local_handoff``), or a queue or task this worker does not consume — republish.
    - On the loop: run it here (D4, no broker round trip); off the loop: hand it to the loop when one runs for
      us (its timers), else republish.
    """
    if closed:
        return Route.REPUBLISH
    if promotion.nonce is not None and not pool_has_room:
        return Route.REPUBLISH
    if not (local_handoff and consumes):
        return Route.REPUBLISH
    if on_loop:
        return Route.RUN_HERE
    return Route.TO_LOOP if loop_runs else Route.REPUBLISH


class Handoff:
    """Dispatch of promotions and the loop-calls pipe of one gate. ``drain`` is the loop's ``*_once``: it runs
    what the threads handed over; ``attach`` / ``detach`` are safe to call twice."""

    def __init__(
        self, *, app: Any, settings: Any, consumer: Any, ledger: Any, life: Any, lock: threading.Lock
    ) -> None:
        self.app = app
        self.settings = settings
        self.consumer = consumer  # set again by the gate at each consumer start
        self.ledger = ledger
        self.life = life  # the gate's lifecycle (worker/running.py): closed, timers
        self.lock = lock
        # Collaborators built after the handoff (they need it), set by the gate's wiring: the releaser, the breaker,
        # the revokes, and the receipt path's park_waiting / held_mutex_keys and the events' announce_promoted.
        self.releaser: Any = None
        self.breaker: Any = None
        self.revokes: Any = None
        self.park_waiting: Callable[[], Any] = lambda: 0
        self.held_mutex_keys: Callable[[], set[str]] | None = None
        self.announce_promoted: Callable[..., None] = lambda promotion, *, local: None
        self.prebound: dict[Token, Prebound] = {}  # promotions bound to us at promotion time (D4); under lock
        # promotions found off the loop, to start on it (D4), with the time their release call began (or None)
        self._to_loop: deque[tuple[Promotion, float | None]] = deque()
        self._loop_calls: deque[Callable[[], None]] = deque()  # work for the loop thread (deferred broker acks)
        self._waker: tuple[Any, int, int] | None = None  # (hub, read fd, write fd): threads wake the loop
        self._handoff_strategies: dict[str, tuple[Any, Any, Any]] = {}  # task name -> (strategy, dispatcher, ours)
        self.typical_run: float | None = None  # seconds an attempt here holds its claim (note_run); any thread

    # -- the loop-calls pipe -----------------------------------------------------------------------------

    def attach(self, hub: Any) -> None:
        """Let the threads wake the consumer loop the moment they hand it work (a pipe the hub reads): no
        polling timer between a promotion found off the loop and its start. Re-attached on every consumer
        start (the hub forgets its readers when the connection resets); the pipe lives as long as the gate."""
        if self._waker is None:
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            self._waker = (hub, read_fd, write_fd)
        else:
            self._waker = (hub, self._waker[1], self._waker[2])
        hub.add_reader(self._waker[1], self._on_wake)

    def detach(self) -> None:
        """The consumer stops: its hub no longer reads the pipe (which stays, for the next start)."""
        if self._waker is not None:
            with contextlib.suppress(Exception):
                self._waker[0].remove_reader(self._waker[1])

    def close(self) -> None:
        """Shutdown, once the threads are stopped (nobody writes to the pipe any more): close it."""
        waker, self._waker = self._waker, None
        if waker is not None:
            for fd in waker[1:]:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def loop_runs(self) -> bool:
        """Whether a consumer loop takes work from us (the pipe, or the gate's loop timers)."""
        return self._waker is not None or bool(self.life.timers)

    def wake_loop(self) -> None:
        """Any thread: make the consumer loop run ``drain`` soon."""
        waker = self._waker
        if waker is None:
            return
        with contextlib.suppress(OSError):  # BlockingIOError: the pipe is full, so a wakeup is pending anyway
            os.write(waker[2], b"\0")

    def call_on_loop(self, call: Callable[[], None]) -> None:
        """Any thread: run ``call`` on the consumer loop soon (woken through the pipe, or the polling timer);
        at once when no loop runs for us (the consumer is stopped: the caller is then Celery's own thread)."""
        if not self.loop_runs():
            call()
            return
        self.defer(call)

    def defer(self, call: Callable[[], None]) -> None:
        """Any thread: queue ``call`` for the loop and wake it (the caller knows a loop runs for us)."""
        self._loop_calls.append(call)
        self.wake_loop()

    def run_loop_calls(self) -> None:
        """Loop thread: run the calls the threads handed over, in order."""
        while self._loop_calls:
            call = self._loop_calls.popleft()
            try:
                call()
            except Exception:
                logger.exception("celery-keyed: deferred work on the consumer loop failed")

    def _on_wake(self, *args: Any) -> None:
        waker = self._waker
        if waker is not None:
            with contextlib.suppress(OSError):
                while os.read(waker[1], 4096):  # read before draining: a later write wakes us again
                    pass
        self.drain()

    def drain(self) -> None:
        """Consumer loop (woken by a thread, or on a timer): run the calls handed over, start the promotions the
        threads found; follow the breaker with the keyed-only queues."""
        self.run_loop_calls()
        started = False
        while self._to_loop:
            promotion, granted = self._to_loop.popleft()
            self.dispatch([promotion], local=True, granted=granted)
            started = True
        if started:  # the promoted keys have a line here now: their requests waiting for a process park without one
            self.park_waiting()
        self.breaker.sync_keyed_queues()

    # -- dispatch of promotions --------------------------------------------------------------------------

    def dispatch(self, promotions: list[Promotion], *, local: bool, granted: float | None = None) -> None:
        """Start promoted attempts where ``route`` says. ``local``: the caller is the consumer loop's thread.
        ``granted``: the monotonic time taken before the ledger call that made these promotions (a release),
        for the promotions it bound to this worker (``Prebound.granted``)."""
        for promotion in promotions:
            closed, local_handoff = self.life.closed, self.settings.local_handoff
            where = route(
                promotion,
                on_loop=local,
                closed=closed,
                local_handoff=local_handoff,
                consumes=local_handoff and not closed and self.consumes(promotion),  # looked up only when it counts
                pool_has_room=promotion.nonce is None or self.pool_has_room(),
                loop_runs=bool(self.life.timers),
            )
            if where is Route.TO_LOOP:
                self._to_loop.append((promotion, granted))
                self.wake_loop()
                continue
            if where is Route.RUN_HERE:
                try:
                    self.run_here(promotion, granted=granted)
                    continue
                except Exception:
                    logger.exception("celery-keyed: local handoff of %s failed; republishing", promotion.task_id)
            self.republish_now(promotion)

    def local_handoff(self, released: str | None = None) -> tuple[list[str] | None, list[str] | None]:
        """Queues (names and routing keys) and tasks this worker consumes, for promotions bound to it at once
        (D4, no bind round trip); None when local handoff is off or the pool is busy (``pool_has_room``;
        ``released``: the key of the release asking)."""
        consumer = self.consumer
        task_consumer = getattr(consumer, "task_consumer", None)
        if (
            not self.settings.local_handoff
            or task_consumer is None
            or self.life.closed
            or not self.pool_has_room(released)
        ):
            return None, None
        queues = getattr(task_consumer, "queues", ())
        return [q.name for q in queues] + [q.routing_key for q in queues], list(consumer.strategies)

    def note_run(self, seconds: float) -> None:
        """Any thread: an attempt here held its claim ``seconds`` (claim to release); kept as the typical run."""
        typical = self.typical_run
        self.typical_run = seconds if typical is None else typical + RUN_WEIGHT * (seconds - typical)

    def pool_has_room(self, released: str | None = None, *, exclude: Any = None) -> bool:
        """Whether a promotion should start here rather than be published for any worker (D4:
        a promotion bound here while the pool is busy holds its slot and keeps its line waiting on this worker
        while others idle).

        Yes when a pool process will be free soon: fewer requests that will run here than pool processes —
        bodies running, and received requests waiting for a process, except those that will most likely park
        and give their process back at once: of keys that parked or promoted here recently, of a mutex key whose
        attempt runs here (``GateService.held_mutex_keys``), and of ``released`` (the key whose release asks: its
        room goes to its line first). A burst of arrivals on busy keys keeps the pool's processes reserved, but
        not for long. A promotion started
        here goes ahead of every request waiting for a process that holds no slot (``join_line``) and starts soon;
        published, it would wait behind the broker's whole queue.

        Also yes when every process has work that will run but the first of them is expected to be free soon: the
        typical run here over the number of processes is at most ``SOON`` (short tasks: the promotion waits one
        short run at most, where published it would wait behind a burst in the broker's queue). Else (the pool busy
        with long work that will run) it is published: another worker may be idle. A promotion bound here that no
        process took within a heartbeat goes back in line (``Heartbeat``), whatever this guess. ``exclude``: a
        received request not to count (a promotion asking whether it can start here)."""
        size, typical = self.pool_size(), self.typical_run
        if size is None or (typical is not None and typical / size <= SOON):
            return True  # short runs: yes whatever the count (counted on every release, so not counted for nothing)
        counted = self._will_run(released, exclude=exclude)
        return counted is None or counted[0] < counted[1]

    def pool_size(self) -> int | None:
        """The consumer's number of pool processes, or None where it has no pool of known size."""
        pool = getattr(self.consumer, "pool", None)
        size = getattr(pool, "num_processes", None) or getattr(pool, "limit", None)
        return size if isinstance(size, int) and size > 0 else None

    def prefetch_spare(self, limit: float) -> int:
        """Messages this worker may hold beyond one per pool process (``GateService.fit_prefetch``): as many as its
        processes are expected to start within ``limit`` seconds, by the typical run here (one process frees every
        typical run / processes), at most one per process; 0 before a run was seen."""
        size, typical = self.pool_size(), self.typical_run
        if size is None or typical is None or limit <= 0:
            return 0
        if typical <= 0:
            return size
        return max(0, min(size, int(limit * size / typical)))

    def start_expected(self, request: Any) -> float | None:
        """Loop thread: seconds ``request`` (received, waiting for a pool process) is expected to wait before one
        starts it: 0.0 when a process is free for it now; else the requests that will run before it over the pool's
        processes, times the typical run here. None when unknown (no typical run yet, or no pool to count)."""
        counted = self._will_run(None, exclude=request)
        if counted is None:
            return None
        will_run, size = counted
        if will_run < size:
            return 0.0
        typical = self.typical_run
        if typical is None:
            return None
        return (will_run - size + 1) * typical / size

    def _will_run(self, released: str | None, *, exclude: Any) -> tuple[int, int] | None:
        """(requests that will run here, pool processes) as ``pool_has_room`` counts them; None without a pool of
        known size."""
        size = self.pool_size()
        if size is None:
            return None
        reserved = list(worker_state.reserved_requests)
        active = worker_state.active_requests
        releaser = self.releaser
        busy: set[str] | None = None  # read when a request needs it (most hold their claim already)
        bound_here: set[str] | None = None  # likewise
        will_run = 0
        for request in reserved:
            if request is exclude:
                continue
            # A request admitted here (it holds its claim, or a claim bound here waits for it) starts on the next
            # free process, even before Celery counts it active; its own key is held by that very claim, so the key
            # rules below must not skip it.
            if getattr(request, "keyed_claim", None) is not None or request in active:
                will_run += 1
                continue
            if bound_here is None:
                with self.lock:
                    bound_here = {token.task_id for token in self.prebound}
            if getattr(request, "id", None) not in bound_here:
                key = getattr(request, "keyed_arrival_key", None)
                if key is None:
                    headers = getattr(request, "_request_dict", None) or {}
                    key = headers.get(HEADER_KEY)
                # A task with several keys (a list header) parks when any of them has a line.
                keys = key if isinstance(key, list) else [key]
                if busy is None:
                    busy = self._busy_keys(released)
                if any(isinstance(k, str) and (k in busy or releaser.is_contended(k)) for k in keys):
                    continue
            will_run += 1
        return will_run, size

    def _busy_keys(self, released: str | None) -> set[str]:
        """The keys whose received requests will park (``_will_run``): the mutex keys held here and ``released``."""
        held_mutex_keys = self.held_mutex_keys
        busy: set[str] = set() if held_mutex_keys is None else held_mutex_keys()
        if released is not None:
            busy.add(released)
        return busy

    def consumes(self, promotion: Promotion) -> bool:
        """Whether this worker consumes the promotion's queue and knows its task."""
        consumer = self.consumer
        record = promotion.message or {}
        task_consumer = getattr(consumer, "task_consumer", None)
        if task_consumer is None or record.get("task") not in consumer.strategies:
            return False
        names = {q.name for q in getattr(task_consumer, "queues", ())}
        routing_keys = {q.routing_key for q in getattr(task_consumer, "queues", ())}
        return record.get("routing_key") in names | routing_keys

    def run_here(self, promotion: Promotion, *, granted: float | None = None) -> None:
        """Loop thread: start the promotion from its stored message through the consumer's strategy."""
        record = promotion.message
        if promotion.nonce is None:  # already bound to this worker in the promotion's transaction
            with self.lock:
                self.prebound[promotion.token] = Prebound(promotion.fence, promotion.key, granted=granted)
        message = restore_message(record, nonce=None if promotion.nonce is None else str(promotion.nonce))
        strategy = self._handoff_strategy(record["task"])
        try:
            strategy(message, None, _already_acked, _already_acked, set())
        except Exception:
            with self.lock:
                self.prebound.pop(promotion.token, None)
            raise
        self.announce_promoted(promotion, local=True)
        if promotion.token in self.prebound and promotion.task_id in worker_state.revoked:
            self.revoked_before_start(promotion.token, promotion.key)  # Celery's strategy discarded it

    def _handoff_strategy(self, task_name: str) -> Any:
        """The consumer's strategy for ``task_name``, built once more for promotions started here: its requests go
        ahead of those that hold no slot in the line for a pool process (``join_line``), and its event dispatcher
        leaves out ``task-received`` (a promotion started here was received, and announced, when it first arrived;
        every later event of its request — started, succeeded… — is sent as usual). Rebuilt when Celery rebuilds
        its strategies (on every broker reconnect)."""
        consumer = self.consumer
        strategy = consumer.strategies[task_name]
        dispatcher = getattr(consumer, "event_dispatcher", None)
        events_on = dispatcher is not None and getattr(dispatcher, "enabled", False)
        semaphore = getattr(getattr(consumer, "controller", None), "semaphore", None)
        if not events_on and semaphore is None:  # no event to leave out, no line for a pool process to jump
            return strategy
        cached = self._handoff_strategies.get(task_name)
        if cached is not None and cached[0] is strategy and cached[1] is dispatcher:
            return cached[2]
        app = self.app
        task = app.tasks[task_name]
        events = _NoReceivedEvent(dispatcher) if events_on else dispatcher
        handoff = default_strategy(task, app, _HandoffConsumer(consumer, events))
        self._handoff_strategies[task_name] = (strategy, dispatcher, handoff)
        return handoff

    def republish_now(self, promotion: Promotion) -> None:
        """Any thread: publish the promotion for any worker; bound here (no nonce): back in line."""
        if promotion.nonce is None:
            # Bound to this worker but it cannot start it here: it goes back in line from its stored message.
            logger.warning("celery-keyed: could not start promoted %s here; it goes back in line", promotion.task_id)
            self.releaser.hand_over(
                promotion.token,
                promotion.fence,
                Outcome.WORKER_LOST,
                key=promotion.key,
                name="",
                contended=True,
                on_loop=False,
            )
            return
        # The one policy for broker errors (a warning; the promotion goes back in line after the dispatch timeout).
        publish_promoted(self.app, [promotion], on_published=lambda p: self.announce_promoted(p, local=False))

    # -- promotions bound here (D4, D14) -----------------------------------------------------------------

    def take_fresh(self, token: Token, *, now: float | None = None) -> int | None:
        """The fence of ``take_fresh_entry``'s entry, or None."""
        entry = self.take_fresh_entry(token, now=now)
        return None if entry is None else entry.fence

    def take_fresh_entry(self, token: Token, *, now: float | None = None) -> Prebound | None:
        """D14 without a round trip: a promotion bound to this worker by its own release (D4), or a claim taken
        ahead at receipt (``ahead``), whose claim provably cannot have lapsed yet, taken out of ``prebound`` (the
        caller starts it now); else None (not bound here, bound another way, or old: ``confirm_prebound`` binds it
        by a guarded statement).

        Why this binds the start as surely as the guarded statement: the release's transaction inserted the
        claim as this holder's running claim with a lease of ``keyed_lease`` from the database's clock, inside a
        call that began after ``granted``; nothing takes a live holder's claim before its lease lapses (the
        reaper needs an expired lease, D7; gone-holder reclaims need every process of the holder gone; an
        operator's forced release is a recorded breach, §3.1). So until ``granted + lease - self_fence_margin``
        on the monotonic clock — the same rule that lets a running attempt go on without asking (self-fencing,
        D7) — the claim is still ours with this fence. The heartbeat renews it from the running table once it
        starts. ``take_fresh`` and ``give_back_prebound`` both pop under ``lock``: only one of them acts."""
        settings = self.settings
        with self.lock:
            prebound = self.prebound.get(token)
            if prebound is None or prebound.granted is None:
                return None
            moment = time.monotonic() if now is None else now
            if moment >= prebound.granted + settings.lease - settings.self_fence_margin:
                return None
            del self.prebound[token]
        return prebound

    def confirm_prebound(self, token: Token) -> int | None:
        """D14: a promotion bound to this worker earlier (D4) starts only if its claim is still this worker's,
        with the same fence (one guarded statement, which also renews the lease). None: not bound here, or its
        claim lapsed while it waited (then it is admitted as usual: the ledger has put it back in line, so this
        copy is a duplicate)."""
        with self.lock:
            prebound = self.prebound.pop(token, None)
        if prebound is None:
            return None
        try:
            confirmed = self.ledger.confirm(token, prebound.fence)
        except UNREACHABLE:
            with self.lock:
                self.prebound.setdefault(token, prebound)  # held with the request; confirmed when resubmitted
            raise
        if not confirmed:
            logger.warning(
                "celery-keyed: the claim of promoted %s attempt %d lapsed before a pool process could start it; "
                "admitting it as usual",
                token.task_id,
                token.attempt,
            )
            return None
        return prebound.fence

    def revoked_before_start(self, token: Token, key: str | None) -> None:
        """A request Celery discards as revoked before it starts here (it stores REVOKED): a promotion bound to this
        worker (D4) or a claim taken ahead gives its slot back with outcome ``revoked``. Without one — a claim taken
        ahead that went back meanwhile (no pool process took it in time), or none at all — the revoke is stored in the
        ledger by the heartbeat (``Revokes.pending``, never a round trip on the loop), which books the task revoked
        unless an attempt of it still holds a claim: the books never stay open beside a REVOKED result (D11, D15)."""
        with self.lock:
            prebound = self.prebound.pop(token, None)
        if prebound is not None:
            self.releaser.hand_over(token, prebound.fence, Outcome.REVOKED, key=key, name="", contended=True)
            return
        self.revokes.pending.append(token.task_id)

    def give_back_prebound(self, stale: Callable[[Prebound], bool], why: str, *, on_loop: bool = True) -> None:
        """Promotions bound here (D4) whose request has not started go back in line (outcome "worker lost": the
        ledger restores them from their stored message and gives the slot to the next in line, which may be
        another worker). The request, if it reaches a pool process later, is then a duplicate (D14, D8)."""
        with self.lock:
            taken = [(token, p) for token, p in self.prebound.items() if stale(p)]
            for token, _ in taken:
                del self.prebound[token]
        for token, p in taken:
            if p.ahead:  # its request, if it starts here later, is admitted again (D8: finished as worker lost)
                logger.info(
                    "celery-keyed: the slot claimed ahead for %s attempt %d goes back: %s",
                    token.task_id,
                    token.attempt,
                    why,
                )
            else:
                logger.warning(
                    "celery-keyed: promoted %s attempt %d goes back in line: %s", token.task_id, token.attempt, why
                )
            self.releaser.hand_over(
                token, p.fence, Outcome.WORKER_LOST, key=p.key, name="", contended=True, on_loop=on_loop
            )


class _NoReceivedEvent:
    """An event dispatcher that forwards every event but ``task-received`` (see ``_handoff_strategy``)."""

    def __init__(self, dispatcher: Any) -> None:
        self._dispatcher = dispatcher

    @property
    def enabled(self) -> bool:
        return bool(self._dispatcher.enabled)

    def send(self, type: str, *args: Any, **fields: Any) -> Any:
        if type == "task-received":
            return None
        return self._dispatcher.send(type, *args, **fields)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dispatcher, name)


class _HandoffConsumer:
    """The consumer as Celery's strategy sees it for a promotion started here: another event dispatcher, and
    requests that take their place among the requests that hold a slot in the line for a pool process
    (``join_line``). Celery's pool semaphore (prefork) queues a request for which no process is free behind every
    request received before it; a promotion has waited its turn in the ledger already, and its claim is held while it
    waits, so it starts on the first process that frees after those that were holding a slot before it."""

    def __init__(self, consumer: Any, event_dispatcher: Any) -> None:
        self._consumer = consumer
        self.event_dispatcher = event_dispatcher

    def on_task_request(self, request: Any) -> Any:
        request.keyed_slot_held = True
        result = self._consumer.on_task_request(request)
        join_line(self._consumer, request)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)


def _already_acked(*args: Any, **kwargs: Any) -> None:
    """ack/reject of a message restored from the ledger: it was acked when it was parked."""
