"""``ReleaseRequest`` (one release of ``Ledger.release_many``) mirrors ``Ledger.release``'s parameters."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from celery_keyed.ledger import Ledger, Outcome, ReleaseRequest, Token


def test_fields_mirror_the_parameters_of_release() -> None:
    params = inspect.signature(Ledger.release).parameters
    mirrored = {name: p.default for name, p in params.items() if name not in ("self", "now")}
    fields = {f.name: f.default for f in dataclasses.fields(ReleaseRequest)}
    assert list(fields) == list(mirrored)
    for name, default in mirrored.items():
        if default is not inspect.Parameter.empty:
            assert fields[name] == default, name


def test_local_queues_and_tasks_become_frozensets() -> None:
    request = ReleaseRequest(Token("t", 0), 7, Outcome.COMPLETED, local_queues=["a", "a"], local_tasks=("x",))
    assert request.local_queues == frozenset({"a"}) and request.local_tasks == frozenset({"x"})
    assert hash(request) == hash(ReleaseRequest(Token("t", 0), 7, Outcome.COMPLETED, local_queues={"a"},
                                                local_tasks={"x"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.fence = 8  # type: ignore[misc]
