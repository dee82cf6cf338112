"""Intake: what the gate reads from a received request before it decides anything — whether the call is keyed,
and the ledger's view of it (``Arrival``): token, keys, deadline and stored message. The keys, group, cost and mode
come from the task's declaration and the call's arguments, whatever the headers say, unless the task takes per-call
keys (``per_call_keys=True``: then from the headers its producers sent, the declaration filling in what they did
not); so no message escapes its task's declared bound through its headers. Everything computed from a message is
checked here, at the gate's edge (D16): a malformed key or a header out of the ledger's range raises ``InvalidKey``,
which the gate turns into a recorded rejection; nothing else reaches the consumer loop as an exception.

Threads: no thread and no state of its own. It runs on the consumer loop (``GateService.execute``), before the
request is handed to admission.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC
from types import SimpleNamespace
from typing import Any

from celery.exceptions import InvalidTaskError
from celery.utils.time import maybe_iso8601, maybe_make_aware

from celery_keyed.call_keys import (
    check_cost,
    check_fair_weight,
    check_limit,
    check_mode,
    check_on_newer,
    evaluate_key,
    evaluate_keys,
    evaluate_limit,
    evaluate_weight,
    key_spec,
)
from celery_keyed.headers import (
    HEADER_COST,
    HEADER_DEBOUNCE,
    HEADER_FAIR,
    HEADER_FAIR_WEIGHT,
    HEADER_GROUP,
    HEADER_GROUP_SEQ,
    HEADER_KEY,
    HEADER_LIMIT,
    HEADER_MODE,
    HEADER_ON_NEWER,
    HEADER_SUPERSEDE,
)
from celery_keyed.ledger import (
    EXCLUSIVE_COST,
    INT_MAX,
    MAX_KEYS_PER_CALL,
    SECONDS_MAX,
    Arrival,
    InvalidKey,
    normalize_key,
    validate_task_id,
)
from celery_keyed.messages import record_message

logger = logging.getLogger("celery_keyed")

#: PostgreSQL's bigint (the ledger's group sequence numbers); attempt numbers and priorities are integers (INT_MAX).
BIGINT_MAX = 2**63 - 1


def is_keyed(request: Any) -> bool:
    """Whether ``request`` may carry a key: a gate header, or a key option on its task. (A call whose options
    evaluate to no key is found out by ``arrival_for``, which then returns None.)"""
    headers = request._request_dict
    if any(h in headers for h in (HEADER_KEY, HEADER_GROUP)):
        return True
    task = request.task
    return key_spec(task, "concurrency_key") is not None or key_spec(task, "group_key") is not None


def unkeyable(exc: BaseException) -> str:
    """The recorded detail of a message whose keys could not be computed or admitted (D16)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"keys could not be computed or admitted: {type(exc).__name__}{': ' + text[:300] if text else ''}"


def arrival_for(request: Any) -> Arrival | None:
    """The ledger's view of a request: its token, keys (declared, or sent for a task that takes per-call keys: see
    the module's docstring), deadline and stored message. None: the call carries no key after all (Celery's own
    path). Malformed keys, and integers out of the ledger's range, raise ``InvalidKey``; so does a key callable (or
    an argument's ``__format__``) that raised ``SystemExit``, ``KeyboardInterrupt`` or any other ``BaseException``
    while no shutdown of this worker is under way (D16: it ran on the consumer loop, which catches ``Exception``
    only, killed the worker, and the message, restored unacked, killed every worker that took it)."""
    try:
        return _arrival_for(request)
    except Exception:
        raise
    except BaseException as exc:
        if is_shutdown(exc):
            raise
        raise InvalidKey(unkeyable(exc)) from None


def is_shutdown(exc: BaseException) -> bool:
    """Whether a ``BaseException`` raised while a message's keys were computed is this process being stopped (then it
    must go on up) rather than the message's own code: Celery's worker turns SIGTERM / SIGINT / SIGQUIT into its
    shutdown flags (raising ``WorkerTerminate`` from the handler on a hard shutdown, with the flag set), and outside
    a worker's handlers Python's own SIGINT handler raises ``KeyboardInterrupt``."""
    from celery.worker import state

    if state.should_stop is not None or state.should_terminate is not None:
        return True
    return isinstance(exc, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _arrival_for(request: Any) -> Arrival | None:
    check_time_limits(request)
    # A gate header that is present but null is treated as absent (a foreign producer's ``None``): the keys
    # are then computed from the arguments, never skipped.
    headers = {k: v for k, v in request._request_dict.items() if v is not None}
    task = request.task
    sent = bound_headers(headers, task)  # every gate header is checked, whoever sent it
    declared = Declared(request)
    key, group, cost, mode, seq = _bound_of(request, headers, sent, declared)
    supersede, fair, weight = _sharing_of(headers, sent, declared)
    if key is None and group is None:
        return None
    validate_task_id(request.id)
    keys = [key] if isinstance(key, str) else list(key or [])
    if keys and check_mode(mode, task, cost=cost, keys=keys):
        cost = EXCLUSIVE_COST  # runs alone on its key (readers and writers; bounds.EXCLUSIVE_COST)
    retries, priority = _checked_numbers(request, headers, seq)
    limit = _limit_of(request, headers, declared) if keys else None
    return Arrival(
        task_id=request.id,
        attempt=retries,
        key=keys[0] if keys else None,
        extra_keys=tuple(keys[1:]),
        cost=cost,
        fair_key=fair,
        fair_weight=weight,
        group_key=group,
        group_seq=seq,
        task_name=request.name,
        priority=priority,
        deadline=request._expires,
        supersede_key=supersede,
        queue=(request.delivery_info or {}).get("routing_key"),
        message=record_message(request._message, task_name=request.name),
        on_newer=on_newer_of(request, keys),
        call_limit=limit,
        **debounce_of(request, keys, group, retries),
    )


def _bound_of(
    request: Any, headers: Mapping[str, Any], sent: SentOptions, declared: Declared
) -> tuple[str | list[str] | None, str | None, int, str, Any]:
    """The options that decide which bound applies (keys, group, cost, mode) and the group number: what the message
    says for a task that accepts per-call keys; else what the task declares for these arguments, whatever the headers
    say (a header never lets a message escape its task's declared bound). An absent header never drops a declared
    key. A message whose headers differ from the declaration is logged, and its group number dropped with its group."""
    task = request.task
    trusted = accepts_per_call_keys(task)
    key = sent.key if trusted and sent.key is not None else declared.key()
    group = sent.group if trusted and sent.group is not None else declared.group()
    cost = sent.cost if trusted and sent.cost is not None else check_cost(getattr(task, "concurrency_cost", 1), task)
    mode = sent.mode if trusted and sent.mode is not None else getattr(task, "concurrency_mode", "shared")
    seq = headers.get(HEADER_GROUP_SEQ)
    if not trusted:
        ignored = sent.differing(key=key, group=group, cost=cost, mode=mode)
        if ignored:
            logger.warning(
                "celery-keyed: %s[%s]: the declared %s applies, not the message's (the task does not accept "
                "per-call keys: per_call_keys=True)", request.name, str(request.id)[:300], ", ".join(ignored),
            )
            if "group_key" in ignored:
                seq = None  # the number belongs to the group the message named
    return key, group, cost, mode, seq


def _limit_of(request: Any, headers: Mapping[str, Any], declared: Declared) -> int | None:
    """The limit of the first key as the call computed it: the message's for a task that accepts per-call keys (when
    it sent one), else what the task declares for these arguments (``concurrency_limit``), as the keys are: a header
    never raises a key's limit past its task's declaration. A header that differs from the declaration is logged."""
    task = declared.task
    sent = check_limit(headers.get(HEADER_LIMIT), task)  # checked whoever sent it
    if sent is not None and accepts_per_call_keys(task):
        return sent
    spec = key_spec(task, "concurrency_limit")
    limit = None if spec is None else evaluate_limit(spec, task, *declared.call())
    if sent is not None and sent != limit:
        logger.warning(
            "celery-keyed: %s[%s]: the declared concurrency_limit applies (%s), not the message's (%s) (the task does "
            "not accept per-call keys: per_call_keys=True)", request.name, str(request.id)[:300], limit, sent,
        )
    return limit


def _sharing_of(
    headers: Mapping[str, Any], sent: SentOptions, declared: Declared
) -> tuple[str | None, str | None, float | None]:
    """The supersede key, fair key and fair weight: as sent when the producer set the keyed headers (it decided
    them), else computed from the declaration and the call's arguments."""
    task = declared.task
    if HEADER_KEY in headers or HEADER_GROUP in headers:
        fair = headers.get(HEADER_FAIR)
        return sent.supersede, None if fair is None else normalize_key(fair), check_fair_weight(
            headers.get(HEADER_FAIR_WEIGHT), task
        )
    fair = declared.evaluate("fair_key")
    weight = evaluate_weight(key_spec(task, "fair_weight"), task, *declared.call()) if fair is not None else None
    return declared.evaluate("supersede_key"), fair, weight


def _checked_numbers(request: Any, headers: Mapping[str, Any], seq: Any) -> tuple[int, int]:
    """The message's attempt (``retries``) and priority, and its group number, each checked (``InvalidKey``)."""
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= BIGINT_MAX):
        raise InvalidKey(f"header {HEADER_GROUP_SEQ} must be an integer from 0 to {BIGINT_MAX}, got {seq!r}")
    retries = headers.get("retries") or 0
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= INT_MAX:
        raise InvalidKey(f"header retries must be an integer from 0 to {INT_MAX}, got {retries!r}")
    priority = (request.delivery_info or {}).get("priority") or 0
    if isinstance(priority, bool) or not isinstance(priority, int) or not -INT_MAX <= priority <= INT_MAX:
        raise InvalidKey(f"message priority must be an integer, got {priority!r}")
    return retries, int(priority)


def accepts_per_call_keys(task: Any) -> bool:
    """Whether the task takes its keys, group, cost and mode from the message (``per_call_keys=True``: its producers
    are trusted to set them per call), rather than from its declaration and the call's arguments."""
    return getattr(task, "per_call_keys", False) is True


class Declared:
    """The keys a request's task declares, computed from the call's arguments when asked (a trusted message's headers
    may make them unneeded: its arguments are then not read)."""

    def __init__(self, request: Any) -> None:
        self.request = request
        self.task = request.task
        self._call: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def call(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self._call is None:
            self._call = (tuple(self.request.args), dict(self.request.kwargs))
        return self._call

    def key(self) -> str | list[str] | None:
        spec = key_spec(self.task, "concurrency_key")
        return None if spec is None else evaluate_keys(spec, self.task, *self.call())

    def group(self) -> str | None:
        return self.evaluate("group_key")

    def evaluate(self, option: str) -> str | None:
        spec = key_spec(self.task, option)
        return None if spec is None else evaluate_key(spec, self.task, *self.call(), option=option)


@dataclass(frozen=True)
class SentOptions:
    """The gate headers of a message that decide its bound, and its supersede key, each checked (``InvalidKey`` when
    malformed, whoever sent it); None where absent."""

    key: str | list[str] | None
    group: str | None
    cost: int | None
    mode: str | None
    supersede: str | None

    def differing(self, *, key: Any, group: Any, cost: int, mode: str) -> list[str]:
        """The options the message sent that differ from the declared ones (by their task option names)."""
        pairs = (
            ("concurrency_key", self.key, key), ("group_key", self.group, group),
            ("concurrency_cost", self.cost, cost), ("concurrency_mode", self.mode, mode),
        )  # fmt: skip
        return [name for name, sent, declared in pairs if sent is not None and sent != declared]


def bound_headers(headers: Mapping[str, Any], task: Any) -> SentOptions:
    """The bound's gate headers of a message (nulls already dropped), checked."""
    group = headers.get(HEADER_GROUP)
    supersede = headers.get(HEADER_SUPERSEDE)
    cost = headers.get(HEADER_COST)
    mode = headers.get(HEADER_MODE)
    if mode is not None:
        check_mode(mode, task)
    return SentOptions(
        key=header_keys(headers.get(HEADER_KEY)),
        group=None if group is None else normalize_key(group),
        cost=None if cost is None else check_cost(cost, task),
        mode=mode,
        supersede=None if supersede is None else normalize_key(supersede),  # as the producer sends it (a key)
    )


def check_message(message: Any, body: Any) -> None:
    """What Celery's strategy and request constructor assume of a task message, checked before they run: a task id
    that is a non-empty str, a usable ``timelimit``, and (protocol 2) a body ``[args, kwargs, embed]``. A foreign
    message shaped otherwise raised out of them on the consumer loop and killed the worker ("Unrecoverable error");
    restored unacked, it then killed the next worker too. Raises Celery's ``InvalidTaskError`` instead, which the
    consumer logs and rejects, as it does for an ETA it cannot parse. Any task's message, keyed or not."""
    headers = message.headers or {}
    payload = message.payload if body is None else body  # decoded once: kombu caches it for the strategy
    if isinstance(payload, dict):  # protocol 1, or Celery's "hybrid" (v2 headers, a v1 body): fields in the body
        fields = {**payload, **headers} if body is None else payload
        if body is None and "args" not in payload:
            raise InvalidTaskError(f"malformed task message: the body is not [args, kwargs, embed]: {payload!r:.200}")
        args, kwargs = payload.get("args", ()), payload.get("kwargs", {})
        if not isinstance(args, list | tuple) or not isinstance(kwargs, dict):
            raise InvalidTaskError(f"malformed task message: args must be a list, kwargs a mapping: {payload!r:.200}")
    elif (
        body is None
        and isinstance(payload, list | tuple)
        and len(payload) == 3
        and isinstance(payload[0], list | tuple)
        and isinstance(payload[1], dict)
        and (payload[2] is None or isinstance(payload[2], dict))
    ):  # protocol 2: the id and options in the headers
        fields = headers
    else:
        raise InvalidTaskError(f"malformed task message: the body is not [args, kwargs, embed]: {payload!r:.200}")
    task_id = fields.get("id")
    if not isinstance(task_id, str) or not task_id:
        raise InvalidTaskError(f"malformed task message: the task id must be a non-empty str, got {task_id!r:.200}")
    try:
        check_time_limits(SimpleNamespace(_request_dict=fields))
    except InvalidKey as exc:
        raise InvalidTaskError(f"malformed task message: {exc}") from None
    for field in ("eta", "expires"):
        check_time(fields, field)


def check_time(fields: Any, field: str) -> None:
    """Celery's ``eta`` / ``expires`` as its request constructor and strategy read them: absent, null, or a datetime /
    ISO 8601 string it can parse, make aware and put on a clock (in UTC, as a timestamp). Else ``InvalidTaskError``,
    raised here — before Celery's own constructor raises the same, or its strategy stores the ``OverflowError`` of a
    time past year 9999 in UTC — so that a keyed task's message is booked as rejected, with a result (``guarded``)."""
    value = fields.get(field)
    if value is None:
        return
    try:
        when = maybe_iso8601(value)
        if when is not None:
            maybe_make_aware(when).astimezone(UTC).timestamp()
    except Exception as exc:
        raise InvalidTaskError(f"malformed task message: invalid {field} value {value!r:.200}: {exc}") from None


def guarded(
    strategy: Callable[..., Any], on_invalid: Callable[[str | None, str], None] | None = None
) -> Callable[..., Any]:
    """``strategy`` (a task's, as Celery's consumer calls it) behind ``check_message``. ``on_invalid(task_id,
    detail)`` is told of a message refused (the task id when it is a str a ledger can hold, else None) before Celery's
    consumer rejects it; it must not raise."""
    if getattr(strategy, "keyed_guarded", False):
        return strategy

    def guarded_strategy(message: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            check_message(message, body)
        except InvalidTaskError as exc:
            if on_invalid is not None:
                on_invalid(_message_id(message, body), str(exc))
            raise
        return strategy(message, body, *args, **kwargs)

    guarded_strategy.keyed_guarded = True  # type: ignore[attr-defined]
    return guarded_strategy


def _message_id(message: Any, body: Any) -> str | None:
    """A refused message's task id, if it has one the books can hold."""
    try:
        headers = message.headers or {}
        task_id = headers.get("id") if "id" in headers else (body if isinstance(body, dict) else {}).get("id")
        if task_id is None and body is None and isinstance(message.payload, dict):
            task_id = message.payload.get("id")
        validate_task_id(task_id)
    except Exception:
        return None
    return task_id


def check_time_limits(request: Any) -> None:
    """Celery's ``timelimit`` header as Celery's pool will use it: empty, or [hard, soft] with each null or a finite
    number of seconds, at least 0. Else ``InvalidKey``: a foreign ``["x", "y"]`` reached kombu's timer on the consumer
    loop and killed the worker ("Unrecoverable error"), with the message's slot claimed."""
    value = request._request_dict.get("timelimit")
    if not value:
        return
    if isinstance(value, list | tuple) and len(value) == 2 and all(_seconds_or_none(v) for v in value):
        return
    raise InvalidKey(f"header timelimit must be [hard, soft], each null or a number of seconds, got {value!r}")


def _seconds_or_none(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return 0 <= value <= SECONDS_MAX and math.isfinite(value)  # an int past a float's range compares first


def on_newer_of(request: Any, keys: list[str]) -> str | None:
    """The newest-wins policy of an arrival: from the ``keyed_on_newer`` header when the message
    carries gate headers (the producer decided: call, task or name), else (``send_task``) the task's own option.
    A malformed header raises ``InvalidKey`` (a recorded rejection, D16)."""
    if not keys:
        return None
    headers = request._request_dict
    if headers.get(HEADER_KEY) is not None or headers.get(HEADER_GROUP) is not None:
        return check_on_newer(headers.get(HEADER_ON_NEWER), request.task)
    return check_on_newer(getattr(request.task, "on_newer", None), request.task)


def debounce_of(request: Any, keys: list[str], group: str | None, retries: int) -> dict[str, Any]:
    """The debounce options of an arrival: from the ``keyed_debounce`` header when the message
    carries gate headers (the producer decided: call, task or name), else (``send_task``) from the task's own
    options. A retry is never debounced. A malformed header, or debounce with a group key, raises ``InvalidKey``
    (a recorded rejection, D16)."""
    if retries or not keys:
        return {}
    headers = request._request_dict
    if headers.get(HEADER_KEY) is not None or headers.get(HEADER_GROUP) is not None:
        value = headers.get(HEADER_DEBOUNCE)
    else:
        task = request.task
        seconds = getattr(task, "debounce", None)
        value = None if seconds is None else [seconds, getattr(task, "debounce_max", None), task.debounce_keep]
    if value is None:
        return {}
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise InvalidKey(f"header {HEADER_DEBOUNCE} must be [seconds, max seconds or null, keep], got {value!r}")
    if group is not None:
        raise InvalidKey("debounce needs a concurrency key and no group key")
    from celery_keyed.ledger import check_debounce

    seconds, maximum, keep = value
    try:
        check_debounce(seconds, maximum, keep)
    except ValueError as exc:
        raise InvalidKey(f"header {HEADER_DEBOUNCE}: {exc}") from None
    return {
        "debounce": float(seconds),
        "debounce_max": None if maximum is None else float(maximum),
        "debounce_keep": keep,
    }


def header_keys(value: Any) -> str | list[str] | None:
    """The concurrency key header: one key, or a list of keys (a task with several). Malformed → InvalidKey."""
    if value is None:
        return None
    if isinstance(value, list):
        if len(value) > MAX_KEYS_PER_CALL:
            raise InvalidKey(f"header {HEADER_KEY} lists {len(value)} keys; a call takes at most {MAX_KEYS_PER_CALL}")
        keys = [normalize_key(v) for v in value]
        if not keys or len(set(keys)) != len(keys):
            raise InvalidKey(f"header {HEADER_KEY} must list distinct keys, got {value!r}")
        return keys[0] if len(keys) == 1 else keys
    return normalize_key(value)
