"""Which messages may name their own keys (README "Guarantees"): a task with ``per_call_keys=True`` runs under the keys,
group, cost and mode its producer sends; any other runs under what it declares for the call's arguments, whatever the
headers say, and its producer refuses a per-call value that differs. Without a broker or a database: the worker's
intake reads a request built here, Celery's publish is a recorder."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery, Task

from celery_keyed import keyed_task
from celery_keyed.headers import HEADER_COST, HEADER_GROUP, HEADER_GROUP_SEQ, HEADER_KEY, HEADER_MODE
from celery_keyed.ledger import EXCLUSIVE_COST, InvalidKey
from celery_keyed.worker.intake import arrival_for


@pytest.fixture
def app() -> Celery:
    app = Celery("unit", set_as_current=False)
    app.conf.keyed_database_url = "postgresql+psycopg://unit@127.0.0.1:1/none"
    return app


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The headers of every message Celery would have published."""
    sent: list[dict[str, Any]] = []

    def apply_async(self: Any, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any):
        sent.append(dict(options.get("headers") or {}))
        return task_id

    monkeypatch.setattr(Task, "apply_async", apply_async)
    return sent


def _request(task: Any, headers: dict[str, Any], args: tuple[Any, ...]) -> Any:
    message = SimpleNamespace(
        headers=headers, properties={}, body=b"", content_type="", content_encoding="", delivery_info={}
    )
    return SimpleNamespace(
        _request_dict=headers, task=task, args=args, kwargs={}, id="t1", name=task.name, delivery_info={},
        _expires=None, _message=message,
    )  # fmt: skip


def _tasks(app: Celery, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, Any]:
    monkeypatch.setattr("celery_keyed.worker.intake.record_message", lambda message, task_name: {})

    @keyed_task(app=app, concurrency_key="acct:{n}", concurrency_cost=2)
    def declared(n: int) -> None: ...

    @keyed_task(app=app, concurrency_key="doc:{n}", concurrency_mode="exclusive")
    def writer(n: int) -> None: ...

    @keyed_task(app=app, concurrency_key="acct:{n}", per_call_keys=True)
    def trusted(n: int) -> None: ...

    return declared._get_current_object(), writer._get_current_object(), trusted._get_current_object()


def test_without_per_call_keys_the_declaration_decides(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    declared, writer, _ = _tasks(app, monkeypatch)
    forged = arrival_for(_request(declared, {HEADER_KEY: "acct:99", HEADER_COST: 1}, (7,)))
    assert forged is not None and (forged.key, forged.cost) == ("acct:7", 2)  # neither another key nor a lower cost
    several = arrival_for(_request(declared, {HEADER_KEY: ["acct:1", "acct:2"]}, (7,)))
    assert several is not None and (several.key, several.extra_keys) == ("acct:7", ())
    group_only = arrival_for(_request(declared, {HEADER_GROUP: "grp:1", HEADER_GROUP_SEQ: 5}, (7,)))
    assert group_only is not None
    assert (group_only.key, group_only.group_key, group_only.group_seq) == ("acct:7", None, None)
    shared = arrival_for(_request(writer, {HEADER_KEY: "doc:1", HEADER_MODE: "shared"}, (1,)))
    assert shared is not None and shared.cost == EXCLUSIVE_COST  # a header cannot make a writer a reader
    # a malformed header is still bad input, whoever sent it: a recorded rejection (D16)
    with pytest.raises(InvalidKey):
        arrival_for(_request(declared, {HEADER_KEY: "acct:\x00"}, (7,)))
    with pytest.raises(InvalidKey):
        arrival_for(_request(declared, {HEADER_COST: "many"}, (7,)))


def test_with_per_call_keys_the_message_decides(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, trusted = _tasks(app, monkeypatch)
    named = arrival_for(_request(trusted, {HEADER_KEY: "acct:99", HEADER_COST: 3}, (7,)))
    assert named is not None and (named.key, named.cost) == ("acct:99", 3)
    # an absent key header never drops the declared key, even here
    group_only = arrival_for(_request(trusted, {HEADER_GROUP: "grp:1"}, (7,)))
    assert group_only is not None and (group_only.key, group_only.group_key) == ("acct:7", "grp:1")


def test_the_producer_refuses_a_per_call_key_the_task_does_not_accept(
    app: Celery, monkeypatch: pytest.MonkeyPatch, published: list[dict[str, Any]]
) -> None:
    declared, writer, trusted = _tasks(app, monkeypatch)
    for option, value in (("concurrency_key", "acct:99"), ("group_key", "grp:1"), ("concurrency_cost", 1)):
        with pytest.raises(InvalidKey, match=f"per-call {option} needs per_call_keys=True"):
            declared.apply_async((7,), **{option: value})
    with pytest.raises(InvalidKey, match="per-call concurrency_mode needs per_call_keys=True"):
        writer.apply_async((1,), concurrency_mode="shared")
    assert published == []
    declared.apply_async((7,), concurrency_key="acct:7", concurrency_cost=2)  # the declared values: fine
    trusted.apply_async((7,), concurrency_key="acct:99")
    assert [h[HEADER_KEY] for h in published] == ["acct:7", "acct:99"]


def test_a_retry_keeps_its_keys_only_when_the_task_takes_per_call_keys(
    app: Celery, monkeypatch: pytest.MonkeyPatch, published: list[dict[str, Any]]
) -> None:
    """Celery copies a message's headers into its retry: without per-call keys the retry's keys are the declared keys
    of its own arguments (as the worker computes them), not the ones the headers carried."""
    declared, _, trusted = _tasks(app, monkeypatch)
    declared.apply_async((8,), headers={HEADER_KEY: "acct:99"}, retries=1)
    trusted.apply_async((8,), headers={HEADER_KEY: "acct:99"}, retries=1)
    assert [h[HEADER_KEY] for h in published] == ["acct:8", "acct:99"]
