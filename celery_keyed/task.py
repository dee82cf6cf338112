"""The task side: ``KeyedTask``, the ``keyed_task`` decorator, and the keys a call carries in its headers.

Keys are computed at publish from the task's arguments (a ``str.format`` template over the bound arguments, a
callable taking the same arguments, a tuple ``(name, ident)``) and sent as message headers. The worker computes them
from the arguments again (as for ``send_task`` from a foreign producer, which sends none) and follows the headers only
for a task with ``per_call_keys=True`` (worker/intake.py): so keys must depend on the call's arguments only.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, Literal, ParamSpec, Protocol, TypeVar, overload

from celery import shared_task

from celery_keyed.call_keys import (  # noqa: F401 (re-exported: task.py's API before call_keys)
    CallOptions,
    KeySpec,
    bind_arguments,
    check_cost,
    check_fair_weight,
    check_mode,
    check_on_newer,
    evaluate_key,
    evaluate_keys,
    evaluate_limit,
    evaluate_weight,
    key_spec,
)
from celery_keyed.canvas import member_of_canvas, refuse_member
from celery_keyed.exceptions import KeyedRejected
from celery_keyed.headers import (  # noqa: F401 (re-exported: the header names are part of task.py's API)
    GATE_HEADERS,
    HEADER_COST,
    HEADER_DEBOUNCE,
    HEADER_FAIR,
    HEADER_FAIR_WEIGHT,
    HEADER_GROUP,
    HEADER_GROUP_SEQ,
    HEADER_KEY,
    HEADER_LIMIT,
    HEADER_MODE,
    HEADER_NONCE,
    HEADER_ON_NEWER,
    HEADER_SUPERSEDE,
    INHERITED,
    NOT_INHERITED,
    OPTION_OF_HEADER,
)
from celery_keyed.in_task import InTaskControls, set_cancel_probe  # noqa: F401 (re-exported)
from celery_keyed.ledger import InvalidKey, validate_task_id
from celery_keyed.publisher import register_group

logger = logging.getLogger("celery_keyed")


#: A template that is one whole field, like "{key}": the argument's value is the key, type-checked as such.


@dataclass(frozen=True)
class _Refused:
    """A canvas member refused at send: its failed result (what ``apply_async`` returns for it)."""

    result: Any


class KeyedTask(InTaskControls):
    """Base class of keyed tasks. Class attributes (set through ``keyed_task(...)`` options):

    - ``concurrency_key``: at most K attempts of this key run at once (K from ``keyed_concurrency_limits``
      by name, else 1);
    - ``group_key``: attempts of one group run strictly one at a time in publish order;
    - ``supersede_key``: under the overflow policy ``supersede``, a newer call with the same supersede key
      replaces a parked one;
    - ``concurrency_limit``: the limit of the call's (first) concurrency key, computed from the call's arguments
      (a callable of the arguments by name, a template naming one argument, ``"{limit}"``, or an integer): each key
      of the name runs as many as its latest call says (``lambda tenant, **_: 10 if premium(tenant) else 2``).
      The operators' overrides of the key, then of its name, win over it; without it the key gets its name's
      ``keyed_concurrency_limits`` limit (docs/features.md "Limits from the call");
    - ``concurrency_cost``: slots the attempt takes of each of its keys (a weighted slot; default 1);
    - ``concurrency_mode``: ``"shared"`` (the default: up to K attempts of a key run together) or
      ``"exclusive"``: the attempt runs alone on its key — it starts when nothing of the key runs, and nothing of
      the key starts while it runs; FIFO across modes, so readers never starve a writer (one concurrency key, an
      unsharded name; docs/features.md "Readers and writers");
    - ``fair_key``: whose share of a ``fair`` name's slots the call uses (e.g. ``"tenant:{tenant_id}"``);
    - ``fair_weight``: that fair key's weight (a positive number, a callable of the call's arguments by name, or a
      template naming one argument, ``"{weight}"``; default: the name's ``keyed_fair_weights``, else 1): while
      several fair keys wait, each one's share of a key's slots follows its weight; a runtime override (``celery
      keyed set-weight``) wins (docs/features.md "Weighted fair sharing");
    - ``debounce`` (seconds), ``debounce_max`` (seconds from the burst's first arrival; default 60, or ``debounce``
      when longer) and ``debounce_keep`` (``"last"``, the default, or ``"first"``): calls of one key within the
      quiet period replace each other and one runs once the key has been quiet that long (docs/features.md
      "Debounce"; per call ``apply_async(..., debounce=5.0)``, ``debounce=None`` for none; per name in
      ``keyed_concurrency_limits``);
    - ``on_newer``: ``"cancel_running"`` (newest wins): a newer call of the same first key and
      supersede key (else the same task) cancels the attempt that holds a slot — prefork terminates its pool
      process, other pools make ``self.keyed_cancelled()`` true — records it ``superseded`` and runs the newest once
      the slot is free; None (the default) keeps today's behaviour: the newer call waits
      (docs/features.md "Newest wins"; per call ``apply_async(..., on_newer=None)``; per name ``on_newer`` in
      ``keyed_concurrency_limits``);
    - ``uncertain_hold``: seconds its slots stay held after a hard time limit or a lost worker, because the
      remote call it made may still be running (default: the names' ``uncertain_hold``, else none);
    - ``admit_at_send``: ask the ledger before publishing (one round trip in the caller's process) and raise
      ``KeyedRejected`` (``celery_keyed.publisher.SendRefused``) instead of publishing when the key's waiting
      room is full or the call's ``dedupe_key`` is live (also per call: ``keyed_admit_at_send=True``; per name:
      ``admit_at_send`` in ``keyed_concurrency_limits``);
    - ``dedupe_key``: a key like the others (template, callable, tuple); at most one task per dedupe key is
      waiting or running (checked at send, so it implies ``admit_at_send``).
    - ``register_at_publish``: store the message in the ledger's outbox at publish, and publish it again from
      there when no worker received it within ``keyed_send_arrival_timeout`` (the broker lost it); also per call
      ``keyed_register_at_publish=True`` (or ``False``), per name ``register_at_publish``, or for every keyed task
      ``keyed_register_at_publish``. With ``keyed_connection=conn`` the message is stored in the caller's
      transaction and published by the relay after it commits (docs/features.md "Nothing lost when the
      broker loses it").

    - ``per_call_keys``: whether a call may name its own ``concurrency_key``, ``group_key``, ``concurrency_cost``,
      ``concurrency_mode`` or ``concurrency_limit`` (``apply_async(..., concurrency_key=...)``, also in
      ``self.retry(...)``), which then wins over the class. Off by default: the worker computes those from the
      declaration and the call's arguments, whatever the message's headers say, so that no message escapes the
      task's declared bound; a per-call value that differs from the declared one raises ``InvalidKey`` at the
      producer (docs/guarantees.md).

    ``concurrency_key`` may be a list of keys: all are claimed at once or none (``["tenant:{tenant_id}",
    "stripe"]``; list the narrow keys first, see docs/ledger.md). Per call, ``apply_async(...,
    supersede_key=..., fair_key=..., fair_weight=...)`` wins over the class, also in ``self.retry(...)``; so do
    ``concurrency_key``, ``group_key``, ``concurrency_cost`` and ``concurrency_mode`` for a task with
    ``per_call_keys=True``.
    ``apply_async(..., keyed_connection=conn)`` registers the group number inside the caller's open
    SQLAlchemy transaction (D10).
    """

    concurrency_key: KeySpec = None
    group_key: KeySpec = None
    supersede_key: KeySpec = None
    concurrency_cost: int = 1
    concurrency_limit: Any = None
    concurrency_mode: str = "shared"
    fair_key: KeySpec = None
    fair_weight: Any = None
    uncertain_hold: float | None = None
    admit_at_send: bool = False
    dedupe_key: KeySpec = None
    register_at_publish: bool = False
    debounce: float | None = None
    debounce_max: float | None = None
    debounce_keep: str = "last"
    on_newer: str | None = None
    per_call_keys: bool = False
    Strategy = "celery_keyed.gate:keyed_strategy"
    Request = "celery_keyed.request:KeyedRequest"

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any) -> Any:
        if task_id is not None:
            validate_task_id(task_id)  # the ledger keys its books by it: refused here, not rejected by the worker
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        call = CallOptions.take(self, options)
        headers, inherited, computed = self._call_headers(args, kwargs, call, options)
        reserved = False
        if call.at_send is not False:
            sent = self._admit_at_send_of(args, kwargs, call, computed, task_id, options)
            if isinstance(sent, _Refused):  # in a canvas: a failed member, not a send raising half-way
                return sent.result
            task_id, reserved = sent
        task_id = self._group_number(computed, inherited, task_id, call.connection)
        headers.update(computed)
        options["headers"] = headers
        try:
            return self._publish(args, kwargs, task_id, computed, call, options)
        except BaseException:
            if reserved and call.connection is None and task_id is not None:  # never published: give its place back
                from celery_keyed.publisher import forget_send

                forget_send(self.app, task_id)
            raise

    def _call_headers(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], call: CallOptions, options: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The message's headers without the keyed ones, the keyed headers it inherited (a retry, a copy), and the
        keyed headers of this call (``computed``: declared or per call, inherited where the call names none, and its
        debounce)."""
        # An admission token and a fence never survive a retry or a copy (headers.NOT_INHERITED).
        headers = {k: v for k, v in dict(options.get("headers") or {}).items() if k not in NOT_INHERITED}
        inherited = {h: headers.pop(h) for h in INHERITED if h in headers}
        computed = self.keyed_headers(args, kwargs, call.explicit)
        trusted = self.per_call_keys is True
        if not trusted:
            self._check_declared_bound(args, kwargs, call.explicit, computed)
        # A retry or a copy keeps the keys it was sent with, unless the call names new ones; without per-call keys,
        # those that decide the bound come from the declaration, as the worker computes them.
        for header, option in OPTION_OF_HEADER.items():
            if option not in call.explicit and header in inherited and (trusted or header not in BOUND_HEADERS):
                computed[header] = inherited[header]
        debounce = None if options.get("retries") else self._debounce_header(call.debounce, computed)
        if debounce is not None:  # a retry is never debounced again (headers.NOT_INHERITED)
            if HEADER_ON_NEWER in computed:
                raise InvalidKey(f"{self.name}: on_newer='cancel_running' and debounce do not combine")
            computed[HEADER_DEBOUNCE] = debounce
        return headers, inherited, computed

    def _admit_at_send_of(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: CallOptions,
        computed: Mapping[str, Any],
        task_id: str | None,
        options: Mapping[str, Any],
    ) -> tuple[str | None, bool] | _Refused:
        """Admit (or park) the call at send when the call, the class or its name asks it, or it has a dedupe key:
        ``(task_id, reserved)``, or ``_Refused`` with the failed result of a refused canvas member."""
        dedupe = evaluate_key(call.dedupe_spec, self, args, kwargs, option="dedupe_key")
        keys = computed.get(HEADER_KEY)
        first = keys[0] if isinstance(keys, list) else keys
        if dedupe is not None and first is None:
            raise InvalidKey(f"{self.name}: dedupe_key {dedupe!r} needs a concurrency key")
        if first is None or not (call.at_send or dedupe is not None or self._admits_at_send(first)):
            return task_id, False
        from celery_keyed.publisher import admit_at_send

        task_id = task_id or str(uuid.uuid4())
        # Before the group number: a refused send registers nothing (a group's lost numbers stay real losses).
        try:
            return task_id, admit_at_send(self.app, task_id, first, dedupe_key=dedupe, connection=call.connection)
        except KeyedRejected as refused:
            if not member_of_canvas(options):
                raise
            return _Refused(refuse_member(self, task_id, options, refused))

    def _group_number(
        self, computed: dict[str, Any], inherited: Mapping[str, Any], task_id: str | None, connection: Any
    ) -> str | None:
        """A group member's number (``HEADER_GROUP_SEQ`` into ``computed``): inherited by a retry or a copy in the same
        group, else registered now (which needs the task id: returned, made here when the call had none)."""
        if HEADER_GROUP not in computed:
            return task_id
        same_group = inherited.get(HEADER_GROUP) == computed[HEADER_GROUP]
        if same_group and HEADER_GROUP_SEQ in inherited:
            computed[HEADER_GROUP_SEQ] = inherited[HEADER_GROUP_SEQ]
            return task_id
        task_id = task_id or str(uuid.uuid4())
        seq = register_group(self.app, computed[HEADER_GROUP], task_id, connection)
        if seq is not None:
            computed[HEADER_GROUP_SEQ] = seq
        return task_id

    def _publish(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        task_id: str | None,
        computed: Mapping[str, Any],
        call: CallOptions,
        options: dict[str, Any],
    ) -> Any:
        """Publish through Celery: through the outbox when the publish registers (a first keyed publish) or is a
        registered keyed retry, else as Celery would."""
        if self._registers_at_publish(computed, call.at_publish, options):
            from celery_keyed.publisher import outbox_producer

            task_id = task_id or str(uuid.uuid4())
            with outbox_producer(
                self.app, options, task_id=task_id, task_name=self.name, connection=call.connection
            ) as producer:
                return super().apply_async(args, kwargs, task_id=task_id, producer=producer, **options)
        retry = self._registered_retry(computed, call.at_publish, options, task_id)
        if retry is not None:  # a keyed retry: registered by its attempt, with a copy when the outbox is on
            from celery_keyed.publisher import outbox_producer

            assert task_id is not None  # _registered_retry answers None without one
            with outbox_producer(
                self.app, options, task_id=task_id, task_name=self.name, attempt=int(options["retries"]),
                keep_copy=retry,
            ) as producer:
                return super().apply_async(args, kwargs, task_id=task_id, producer=producer, **options)
        return super().apply_async(args, kwargs, task_id=task_id, **options)

    def _check_declared_bound(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], explicit: Mapping[str, Any], computed: Mapping[str, Any]
    ) -> None:
        """A task without ``per_call_keys`` runs under its declared keys, group, cost and mode (the worker computes
        them from the arguments): a call that names others is refused here, with ``InvalidKey``, rather than
        published with headers the worker would not follow."""
        named = [option for option in BOUND_OPTIONS if option in explicit]
        if not named:
            return
        declared = self.keyed_headers(args, kwargs, {k: v for k, v in explicit.items() if k not in BOUND_OPTIONS})
        differing = [o for o in named if computed.get(_HEADER_OF[o]) != declared.get(_HEADER_OF[o])]
        if differing:
            raise InvalidKey(
                f"{self.name}: a per-call {', '.join(differing)} needs per_call_keys=True on the task (without it, "
                "the worker runs every call under the keys, group, cost, mode and limit the task declares)"
            )

    def _debounce_header(self, call: Mapping[str, Any], computed: Mapping[str, Any]) -> list[Any] | None:
        """The debounce header of a keyed call, ``[seconds, max, keep]``, or None: per call ``debounce=`` (None: not
        this call), else the task's ``debounce``, else its first key's name's in this app's
        ``keyed_concurrency_limits``; ``debounce_max`` / ``debounce_keep`` per call win. ``InvalidKey`` for bad values
        or a call with a group key (bad input never waits)."""
        keys = computed.get(HEADER_KEY)
        if keys is None:
            return None
        if "debounce" in call:
            seconds, maximum, keep = call["debounce"], None, "last"
        elif self.debounce is not None:
            seconds, maximum, keep = self.debounce, self.debounce_max, self.debounce_keep
        else:
            from celery_keyed.publisher import publisher_for

            publisher = publisher_for(self.app)
            first = keys[0] if isinstance(keys, list) else keys
            config = publisher.settings.limits.get(str(first).split(":", 1)[0]) if publisher is not None else None
            if config is None:
                return None
            seconds, maximum, keep = config.debounce, config.debounce_max, config.debounce_keep
        if seconds is None:
            return None
        maximum, keep = call.get("debounce_max", maximum), call.get("debounce_keep", keep)
        if HEADER_GROUP in computed:
            raise InvalidKey(f"{self.name}: debounce needs a concurrency key and no group_key")
        from celery_keyed.ledger import check_debounce

        try:
            check_debounce(seconds, maximum, keep)
        except ValueError as exc:
            raise InvalidKey(f"{self.name}: {exc}") from None
        return [seconds, maximum, keep]

    def _registers_at_publish(
        self, computed: Mapping[str, Any], asked: bool | None, options: Mapping[str, Any]
    ) -> bool:
        """Whether this publish goes through the outbox: a keyed call (a concurrency or group key), not eager, not a
        retry (a retry is registered by its attempt: ``_registered_retry``), asked per call, else by the class, else
        by the settings (every keyed task, or the name of its first key or of its group)."""
        if options.get("retries"):
            return False
        return self._outbox_on(computed, asked)

    def _registered_retry(
        self, computed: Mapping[str, Any], asked: bool | None, options: Mapping[str, Any], task_id: str | None
    ) -> bool | None:
        """How a keyed retry is registered at its publish: True with its copy (the outbox is on for the task: the
        relay publishes it again if it never arrives), False without (reconcile reports it), None not at all (not a
        retry, not keyed, eager, or an app without a ledger configuration)."""
        retries = options.get("retries")
        if not isinstance(retries, int) or retries < 1 or task_id is None:
            return None
        if not (HEADER_KEY in computed or HEADER_GROUP in computed):
            return None
        if self.app.conf.task_always_eager or getattr(self.request, "is_eager", False):
            return None
        from celery_keyed.publisher import publisher_for

        if publisher_for(self.app) is None:
            return None
        return self._outbox_on(computed, asked)

    def _outbox_on(self, computed: Mapping[str, Any], asked: bool | None) -> bool:
        """Whether the outbox is on for a keyed publish: asked per call, else by the class, else by the settings."""
        if asked is False or not (HEADER_KEY in computed or HEADER_GROUP in computed):
            return False
        if self.app.conf.task_always_eager or getattr(self.request, "is_eager", False):
            return False
        if asked or self.register_at_publish:
            return True
        from celery_keyed.publisher import registers_at_publish

        keys = computed.get(HEADER_KEY, computed.get(HEADER_GROUP))
        first = keys[0] if isinstance(keys, list) else keys
        return registers_at_publish(self.app, str(first).split(":", 1)[0] if first is not None else None)

    def _admits_at_send(self, key: str) -> bool:
        """``admit_at_send`` of the class, else of the key's name in ``keyed_concurrency_limits``."""
        if self.admit_at_send:
            return True
        from celery_keyed.publisher import admits_at_send

        return admits_at_send(self.app, key.split(":", 1)[0])

    def keyed_headers(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], explicit: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The gate headers for a call with these arguments (raises :class:`InvalidKey` for a bad key)."""
        explicit = explicit or {}
        headers: dict[str, Any] = {}
        for header, option in (
            (HEADER_KEY, "concurrency_key"),
            (HEADER_GROUP, "group_key"),
            (HEADER_SUPERSEDE, "supersede_key"),
            (HEADER_FAIR, "fair_key"),
        ):
            spec = explicit[option] if option in explicit else key_spec(self, option)
            value = evaluate_keys(spec, self, args, kwargs) if option == "concurrency_key" else (
                evaluate_key(spec, self, args, kwargs, option=option)
            )
            if value is not None:
                headers[header] = value
        if HEADER_FAIR in headers:
            spec = explicit["fair_weight"] if "fair_weight" in explicit else key_spec(self, "fair_weight")
            weight = evaluate_weight(spec, self, args, kwargs)
            if weight is not None:
                headers[HEADER_FAIR_WEIGHT] = weight
        if HEADER_KEY in headers:
            spec = explicit.get("concurrency_limit", key_spec(self, "concurrency_limit"))
            limit = evaluate_limit(spec, self, args, kwargs)
            if limit is not None:
                headers[HEADER_LIMIT] = limit
        cost = explicit.get("concurrency_cost", self.concurrency_cost)
        check_cost(cost, self)
        if cost != 1 and HEADER_KEY in headers:
            headers[HEADER_COST] = cost
        on_newer = self._on_newer(explicit, headers.get(HEADER_KEY))
        if on_newer is not None:
            headers[HEADER_ON_NEWER] = on_newer
        mode = explicit.get("concurrency_mode", self.concurrency_mode)
        exclusive = check_mode(mode, self, cost=cost, keys=headers.get(HEADER_KEY))
        if HEADER_KEY in headers and (exclusive or self.concurrency_mode != "shared"):
            headers[HEADER_MODE] = mode  # the worker falls back to the class's mode only without the header
        return headers

    def _on_newer(self, explicit: Mapping[str, Any], keys: Any) -> str | None:
        """The newest-wins policy of a keyed call: per call ``on_newer=`` (None: not this call), else the task's, else
        its first key's name's in this app's ``keyed_concurrency_limits``. ``InvalidKey`` for an unknown value."""
        if keys is None:
            return None
        if "on_newer" in explicit:
            policy = explicit["on_newer"]
        elif self.on_newer is not None:
            policy = self.on_newer
        else:
            from celery_keyed.publisher import publisher_for

            publisher = publisher_for(self.app)
            first = keys[0] if isinstance(keys, list) else keys
            config = publisher.settings.limits.get(str(first).split(":", 1)[0]) if publisher is not None else None
            policy = None if config is None else config.on_newer
        return check_on_newer(policy, self)

#: The task options that decide which bound a call runs under, and their headers: per call only with
#: ``per_call_keys=True`` (else the worker computes them from the declaration and the arguments).
BOUND_OPTIONS = ("concurrency_key", "group_key", "concurrency_cost", "concurrency_mode", "concurrency_limit")
_HEADER_OF = {option: header for header, option in OPTION_OF_HEADER.items()}
BOUND_HEADERS = tuple(_HEADER_OF[option] for option in BOUND_OPTIONS)

P = ParamSpec("P")
R = TypeVar("R", covariant=True)


class KeyedTaskFunction(Protocol[P, R]):
    """What ``@keyed_task`` gives, as a type checker sees it: the task (a :class:`KeyedTask`), called, delayed
    and signed with the decorated function's own parameters (without ``self`` for ``bind=True``)."""

    name: str

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def apply_async(
        self,
        args: tuple[Any, ...] | list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> Any: ...

    def s(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def si(self, *args: P.args, **kwargs: P.kwargs) -> Any: ...

    def keyed_headers(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], explicit: Mapping[str, Any] | None = None
    ) -> dict[str, Any]: ...


@overload
def keyed_task(fun: Callable[P, R], /) -> KeyedTaskFunction[P, R]: ...


@overload
def keyed_task(
    *,
    bind: Literal[True],
    concurrency_key: KeySpec = ...,
    dedupe_key: KeySpec = ...,
    admit_at_send: bool = ...,
    register_at_publish: bool = ...,
    group_key: KeySpec = ...,
    supersede_key: KeySpec = ...,
    fair_key: KeySpec = ...,
    fair_weight: Any = ...,
    concurrency_cost: int = ...,
    concurrency_limit: Any = ...,
    concurrency_mode: str = ...,
    on_newer: str | None = ...,
    per_call_keys: bool = ...,
    **options: Any,
) -> Callable[[Callable[Concatenate[Any, P], R]], KeyedTaskFunction[P, R]]: ...


@overload
def keyed_task(
    *,
    bind: Literal[False] = ...,
    concurrency_key: KeySpec = ...,
    dedupe_key: KeySpec = ...,
    admit_at_send: bool = ...,
    register_at_publish: bool = ...,
    group_key: KeySpec = ...,
    supersede_key: KeySpec = ...,
    fair_key: KeySpec = ...,
    fair_weight: Any = ...,
    concurrency_cost: int = ...,
    concurrency_limit: Any = ...,
    concurrency_mode: str = ...,
    on_newer: str | None = ...,
    per_call_keys: bool = ...,
    **options: Any,
) -> Callable[[Callable[P, R]], KeyedTaskFunction[P, R]]: ...


def keyed_task(*args: Any, **options: Any) -> Any:
    """Declare a keyed task: ``@keyed_task(concurrency_key="account:{account_id}")``.

    For a type checker the result keeps the function's signature (``KeyedTaskFunction``): ``delay``, ``s`` and
    calls are checked against it; with ``bind=True`` the first parameter (the task) is left out.

    Accepts every option of ``shared_task`` / ``app.task`` plus ``concurrency_key``, ``concurrency_limit``,
    ``group_key``,
    ``supersede_key``, ``dedupe_key``, ``admit_at_send``, ``register_at_publish``, ``on_newer`` and ``per_call_keys``.
    Pass ``app=`` to register on a specific app instead of every app (shared_task).
    """
    app = options.pop("app", None)
    options.setdefault("base", KeyedTask)
    if not issubclass(options["base"], KeyedTask):
        raise TypeError("keyed_task(base=...) must be a subclass of celery_keyed.KeyedTask")
    if app is not None:
        options.setdefault("shared", False)  # this app only (Celery's app.task would register it on every app)
        return app.task(*args, **options)
    return shared_task(*args, **options)
