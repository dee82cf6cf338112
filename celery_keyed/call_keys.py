"""What a call's arguments make of a keyed task's declared options: its keys (templates, callables, tuples, lists),
its fair weight, its mode and its cost, each checked — at the producer (``KeyedTask.apply_async``) and at the worker,
which computes the declared keys of every message again (``worker/intake.py``). No Celery here but the task object
passed in: the worker's intake uses these without importing ``celery_keyed.task`` (and through it the package root).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_keyed.ledger import COST_MAX, MAX_KEYS_PER_CALL, InvalidKey, normalize_key

#: A key spec as declared: a template, a (name, value) tuple, a callable of the call's arguments, a list (several
#: keys, concurrency_key only), or None.
KeySpec = str | tuple[str, Any] | Callable[..., Any] | list[Any] | None
_WHOLE_FIELD = re.compile(r"^\{(\w+)\}$")


def key_spec(task: Any, option: str) -> KeySpec:
    """A task's key spec as declared: a callable class attribute is not bound to the task (it gets the call's
    arguments, not ``self``)."""
    value = _static_attribute(task, option)
    if isinstance(value, staticmethod | classmethod):
        value = value.__get__(None, type(task))
    return value


def _static_attribute(obj: Any, name: str) -> Any:
    """``inspect.getattr_static(obj, name, None)`` for a task object, without its general machinery (this runs for
    every option of every keyed publish and every received message): a data descriptor of the class, else the
    instance's own attribute, else the class's."""
    found: Any = None
    for klass in type(obj).__mro__:
        if name in klass.__dict__:
            found = klass.__dict__[name]
            break
    else:
        return getattr(obj, "__dict__", {}).get(name)
    if hasattr(type(found), "__set__") or hasattr(type(found), "__delete__"):
        return found
    own = getattr(obj, "__dict__", {})
    return own.get(name, found)


def evaluate_key(
    spec: KeySpec, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, option: str = "concurrency_key"
) -> str | None:
    """Evaluate a key spec against a call's arguments; the normalised key or None (unkeyed for this call)."""
    if spec is None:
        return None
    if callable(spec) and not isinstance(spec, str | tuple):
        value = spec(**bind_arguments(task, args, kwargs))  # by parameter name: lambda tenant_id, **_: ...
        if value is None:
            return None
        return _normalize(value, task, option)
    if isinstance(spec, str) and "{" in spec:
        arguments = bind_arguments(task, args, kwargs)
        whole = _WHOLE_FIELD.match(spec)
        if whole and whole.group(1) in arguments:  # "{key}": the argument itself (a str or a tuple key)
            value = arguments[whole.group(1)]
            return None if value is None else _normalize(value, task, option)
        try:
            rendered = spec.format(**arguments)
        except (KeyError, IndexError, AttributeError) as exc:
            raise InvalidKey(
                f"{task.name}: {option} template {spec!r} names {exc} which the call's arguments "
                f"({sorted(arguments)}) do not have"
            ) from None
        return _normalize(rendered, task, option)
    if isinstance(spec, list):
        raise InvalidKey(f"{task.name}: {option} must be one key (only concurrency_key takes a list)")
    return _normalize(spec, task, option)


def evaluate_weight(spec: Any, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    """A ``fair_weight`` spec against a call's arguments: None (no weight of its own), a number, a callable of the
    arguments by name, or a template naming one argument (``"{weight}"``); the checked weight (``InvalidKey`` for
    anything else: bad input never waits)."""
    return check_fair_weight(_call_value(spec, task, args, kwargs, "fair_weight", "{weight}"), task)


def _call_value(spec: Any, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], option: str, example: str) -> Any:
    """The value a number-valued option (``fair_weight``, ``concurrency_limit``) gives a call, unchecked: a callable
    of the arguments by name, called; a template naming one argument (``example``), that argument; else the spec."""
    if callable(spec):
        return spec(**bind_arguments(task, args, kwargs))
    if isinstance(spec, str):
        whole = _WHOLE_FIELD.match(spec)
        arguments = bind_arguments(task, args, kwargs)
        if whole is None or whole.group(1) not in arguments:
            raise InvalidKey(f"{task.name}: {option} {spec!r} must name one argument of the call, like '{example}'")
        return arguments[whole.group(1)]
    return spec


def check_fair_weight(value: Any, task: Any) -> float | None:
    """A fair weight from a call or a header: None, or a number from FAIR_WEIGHT_MIN to FAIR_WEIGHT_MAX
    (``InvalidKey`` otherwise)."""
    if value is None:
        return None
    from celery_keyed.ledger import InvalidConfig, check_weight

    try:
        return check_weight(value, f"{getattr(task, 'name', task)}: fair_weight")
    except InvalidConfig as exc:
        raise InvalidKey(str(exc)) from None


def evaluate_limit(spec: Any, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """A ``concurrency_limit`` spec against a call's arguments: None (the name's configured limit applies), an
    integer, a callable of the arguments by name, or a template naming one argument (``"{limit}"``); the checked
    limit (``InvalidKey`` for anything else: bad input never waits)."""
    return check_limit(_call_value(spec, task, args, kwargs, "concurrency_limit", "{limit}"), task)


def check_limit(value: Any, task: Any) -> int | None:
    """A key's limit from a call or a header: None, or an integer from 0 to ``SLOT_LIMIT_MAX`` (``InvalidKey``
    otherwise)."""
    if value is None:
        return None
    from celery_keyed.ledger import InvalidConfig, check_call_limit

    try:
        return check_call_limit(value, f"{getattr(task, 'name', task)}: concurrency_limit")
    except InvalidConfig as exc:
        raise InvalidKey(str(exc)) from None


def evaluate_keys(spec: KeySpec, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | list[str] | None:
    """A concurrency key spec against a call's arguments: one key, a list of keys (a list spec: each item a
    template, callable, tuple or string; items that come out None are left out), or None (unkeyed)."""
    if not isinstance(spec, list):
        return evaluate_key(spec, task, args, kwargs)
    if len(spec) > MAX_KEYS_PER_CALL:
        raise InvalidKey(
            f"{task.name}: concurrency_key lists {len(spec)} keys; a call takes at most {MAX_KEYS_PER_CALL}"
        )
    found = [k for k in (evaluate_key(item, task, args, kwargs) for item in spec) if k is not None]
    if len(set(found)) != len(found):
        raise InvalidKey(f"{task.name}: concurrency_key lists the same key twice: {found!r}")
    if not found:
        return None
    return found[0] if len(found) == 1 else found


def check_mode(mode: Any, task: Any, *, cost: Any = 1, keys: Any = None) -> bool:
    """Whether ``concurrency_mode`` is ``"exclusive"`` (``InvalidKey`` for anything but "shared" / "exclusive", and
    for an exclusive call with a cost or with several concurrency keys: bad input never waits)."""
    if mode not in ("shared", "exclusive"):
        name = getattr(task, "name", task)
        raise InvalidKey(f"{name}: concurrency_mode must be 'shared' or 'exclusive', got {mode!r}")
    if mode == "shared":
        return False
    if cost != 1:
        raise InvalidKey(f"{getattr(task, 'name', task)}: an exclusive task takes its whole key; no concurrency_cost")
    if isinstance(keys, list | tuple) and len(keys) > 1:
        raise InvalidKey(f"{getattr(task, 'name', task)}: an exclusive task needs exactly one concurrency key")
    return True


def check_on_newer(policy: Any, task: Any) -> str | None:
    """``on_newer`` must be None or "cancel_running" (``InvalidKey`` otherwise: bad input never waits)."""
    from celery_keyed.ledger import check_on_newer as check

    try:
        check(policy)
    except ValueError as exc:
        raise InvalidKey(f"{getattr(task, 'name', task)}: {exc}") from None
    return None if policy is None else str(policy)


def check_cost(cost: Any, task: Any) -> int:
    """A concurrency cost must be a positive integer up to ``COST_MAX``, the most slots a key can have (``InvalidKey``
    otherwise: bad input never waits, and never reaches the ledger's integer columns). The producer checks it before
    it sends, the worker's intake again for a foreign producer's ``keyed_cost`` header."""
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise InvalidKey(f"{getattr(task, 'name', task)}: concurrency_cost must be a positive integer, got {cost!r}")
    if cost > COST_MAX:
        raise InvalidKey(
            f"{getattr(task, 'name', task)}: concurrency_cost {cost} exceeds the largest cost {COST_MAX}"
            " (the most slots a key can have)"
        )
    return cost


def bind_arguments(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults applied (for key templates)."""
    run = task.run
    try:
        signature = _signature(run)
        plan = _plain_plan(run)
    except TypeError:  # an unhashable callable as run: read its signature each time
        signature, plan = inspect.signature(run), None
    if plan is not None:
        arguments = plan.bind(args, kwargs)
        if arguments is not None:
            return arguments
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise InvalidKey(f"{task.name}: cannot bind arguments {args!r} {kwargs!r} to compute its key: {exc}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return arguments


@functools.lru_cache(maxsize=4096)
def _signature(run: Callable[..., Any]) -> inspect.Signature:
    """The signature of a task's ``run`` (a function, or a method bound to its task: equal and hashable by both), read
    once: ``inspect.signature`` is most of what binding a call's arguments costs."""
    return inspect.signature(run)


@dataclass(frozen=True)
class _PlainPlan:
    """How to bind a call to a signature of plain parameters (no positional-only, no ``*args``) the way
    ``Signature.bind_partial`` + ``apply_defaults`` does, without its general machinery (every keyed message and
    publish binds its call once or more). ``bind`` returns None for any call it does not bind plainly (too many
    positional arguments, a name given twice, an unknown name): the signature then binds it and says what is wrong."""

    positional: tuple[str, ...]
    names: frozenset[str]
    defaults: tuple[tuple[str, Any], ...]
    var_keyword: bool

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if len(args) > len(self.positional):
            return None
        arguments = dict(zip(self.positional, args, strict=False))
        for name, value in kwargs.items():
            if name in arguments or (name not in self.names and not self.var_keyword):
                return None
            arguments[name] = value
        for name, default in self.defaults:
            if name not in arguments:
                arguments[name] = default
        return arguments


@functools.lru_cache(maxsize=4096)
def _plain_plan(run: Callable[..., Any]) -> _PlainPlan | None:
    """The plain binding plan of a task's ``run``, or None when its signature is not plain (``_PlainPlan``)."""
    signature = _signature(run)
    kinds = inspect.Parameter
    positional: list[str] = []
    names: set[str] = set()
    defaults: list[tuple[str, Any]] = []
    var_keyword = False
    for name, param in signature.parameters.items():
        if param.kind is kinds.POSITIONAL_OR_KEYWORD:
            positional.append(name)
        elif param.kind is kinds.VAR_KEYWORD:
            var_keyword = True
            continue
        elif param.kind is not kinds.KEYWORD_ONLY:
            return None  # positional-only or *args: the signature binds it
        names.add(name)
        if param.default is not kinds.empty:
            defaults.append((name, param.default))
    return _PlainPlan(tuple(positional), frozenset(names), tuple(defaults), var_keyword)


def _normalize(value: Any, task: Any, option: str) -> str:
    try:
        return normalize_key(value)
    except InvalidKey as exc:
        raise InvalidKey(f"{task.name}: {option}: {exc}") from None


#: The keyed options a call may name (taken out of Celery's options by ``CallOptions.take``).
CALL_KEY_OPTIONS = (
    "concurrency_key", "group_key", "supersede_key", "concurrency_cost", "fair_key", "concurrency_mode", "fair_weight",
    "on_newer", "concurrency_limit",
)


@dataclass(frozen=True)
class CallOptions:
    """What one ``apply_async`` call says beyond Celery's own options (``take`` takes them out of those)."""

    explicit: dict[str, Any]  # keys, group, cost, mode, fair key / weight, on_newer named by the call
    connection: Any  # keyed_connection: the caller's ledger connection (its transaction)
    at_send: bool | None  # keyed_admit_at_send
    at_publish: bool | None  # keyed_register_at_publish
    dedupe_spec: Any  # dedupe_key of the call, else the task's
    debounce: dict[str, Any]  # debounce, debounce_max, debounce_keep of the call

    @classmethod
    def take(cls, task: Any, options: dict[str, Any]) -> CallOptions:
        return cls(
            explicit={name: options.pop(name) for name in CALL_KEY_OPTIONS if name in options},
            connection=options.pop("keyed_connection", None),
            at_send=options.pop("keyed_admit_at_send", None),
            at_publish=options.pop("keyed_register_at_publish", None),
            dedupe_spec=options.pop("dedupe_key") if "dedupe_key" in options else key_spec(task, "dedupe_key"),
            debounce={k: options.pop(k) for k in ("debounce", "debounce_max", "debounce_keep") if k in options},
        )
