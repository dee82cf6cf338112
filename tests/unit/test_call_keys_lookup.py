"""The option lookup and argument binding of call_keys, which run for every keyed publish and every received message,
answer as ``inspect.getattr_static`` and ``inspect.signature`` would."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from celery_keyed.call_keys import _static_attribute, bind_arguments, key_spec


class _Base:
    concurrency_key = "base:{x}"
    group_key = staticmethod(lambda x: f"g:{x}")

    @property
    def fair_key(self) -> str:  # a data descriptor on the class wins over the instance's own attribute
        return "property"

    def run(self, x: int, y: int = 2, **extra: Any) -> None:
        pass


class _Child(_Base):
    supersede_key = "child:{x}"


@pytest.mark.parametrize("name", ["concurrency_key", "group_key", "fair_key", "supersede_key", "missing", "run"])
def test_static_attribute_answers_as_getattr_static(name: str) -> None:
    task = _Child()
    assert _static_attribute(task, name) is inspect.getattr_static(task, name, None)
    task.__dict__[name] = "own"  # an instance's own value: wins unless the class holds a data descriptor
    assert _static_attribute(task, name) is inspect.getattr_static(task, name, None)


def test_key_spec_unwraps_a_static_method_unbound() -> None:
    spec = key_spec(_Child(), "group_key")
    assert callable(spec) and spec(x=3) == "g:3"


def test_bind_arguments_follows_each_run_and_keeps_defaults() -> None:
    class Task:
        name = "t"

        def __init__(self, run: Any) -> None:
            self.run = run

    assert bind_arguments(Task(_Base().run), (1,), {"z": 3}) == {"x": 1, "y": 2, "z": 3}

    def other(a: int, b: int = 5) -> None:
        pass

    assert bind_arguments(Task(other), (), {"a": 7}) == {"a": 7, "b": 5}
    # the same function object read again, and a different one of the same name, each bind by their own signature
    assert bind_arguments(Task(other), (8,), {}) == {"a": 8, "b": 5}

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, q: int) -> None:
            pass

    assert bind_arguments(Task(Unhashable()), (4,), {}) == {"q": 4}


def _reference(run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | str:
    """What ``Signature.bind_partial`` + ``apply_defaults`` (with ``**kwargs`` flattened) make of a call, or the
    error's type name."""
    signature = inspect.signature(run)
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return "InvalidKey"
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    return arguments


def _f1(a: Any, b: Any = 2) -> None: ...
def _f2(a: Any, *, k: Any, m: Any = "m") -> None: ...
def _f3(a: Any, b: Any = None, **extra: Any) -> None: ...
def _f4(a: Any, /, b: Any = 1) -> None: ...
def _f5(a: Any, *rest: Any, b: Any = 1) -> None: ...
def _f6(**everything: Any) -> None: ...
def _f7() -> None: ...


@pytest.mark.parametrize("run", [_f1, _f2, _f3, _f4, _f5, _f6, _f7, _Base().run])
@pytest.mark.parametrize(
    "call",
    [
        ((), {}), ((1,), {}), ((1, 2), {}), ((1, 2, 3), {}), ((), {"a": 1}), ((1,), {"a": 1}), ((1,), {"b": 3}),
        ((1,), {"k": 4}), ((), {"k": 4, "m": 5, "z": 6}), ((1,), {"extra": 9}), ((), {"everything": 1, "x": 2}),
        ((1,), {"y": 7, "x": 8}),
    ],
)
def test_bind_arguments_binds_every_call_as_the_signature_does(run: Any, call: Any) -> None:
    class Task:
        name = "t"

    task = Task()
    task.run = run  # type: ignore[attr-defined]
    args, kwargs = call
    expected = _reference(run, args, kwargs)
    try:
        got: dict[str, Any] | str = bind_arguments(task, args, kwargs)
    except Exception as exc:
        got = type(exc).__name__
    assert got == expected
