"""Key normalisation and validation (no database)."""

from __future__ import annotations

import re

import pytest

from celery_keyed.ledger.errors import InvalidKey
from celery_keyed.ledger.keyspec import MAX_KEY_LENGTH, key_name, normalize_key, validate_name


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("account:7", "account:7"),
        ("stripe", "stripe"),
        (("stripe", "tenant-1"), "stripe:tenant-1"),
        (("account", 7), "account:7"),
        ("s3:bucket:path/to", "s3:bucket:path/to"),
        ("a.b-c_d:x", "a.b-c_d:x"),
        ("account:é😀", "account:é😀"),
    ],
)
def test_normalize_accepts(key: object, expected: str) -> None:
    assert normalize_key(key) == expected


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (7, "must be a str or a (name, ident) tuple"),
        (None, "must be a str or a (name, ident) tuple"),
        (["account", 7], "must be a str or a (name, ident) tuple"),
        (("account",), "must be (name, ident)"),
        (("account", 1, 2), "must be (name, ident)"),
        ((7, "x"), "name of a tuple key must be a str"),
        (("account", True), "ident of a tuple key must be a str or int"),
        (("account", 1.5), "ident of a tuple key must be a str or int"),
        (("account", ""), "must not be empty"),
        ("", "must not be empty"),
        ("account:", "empty identity"),
        (":7", "must start with a letter"),
        ("7up:x", "must start with a letter"),
        ("acc ount:1", "must start with a letter"),
        ("account:a b", "whitespace or control"),
        ("account:a\nb", "whitespace or control"),
        ("account:a\x00b", "whitespace or control"),
        ("account:\ud800", "lone surrogate"),  # JSON's "\ud800": no UTF-8 form, so PostgreSQL cannot store it
        (("account", "x\udfff"), "lone surrogate"),
        ("x" * (MAX_KEY_LENGTH + 1), "at most"),
    ],
)
def test_normalize_rejects_with_a_clear_error(key: object, message: str) -> None:
    with pytest.raises(InvalidKey, match=re.escape(message)):
        normalize_key(key)


def test_longest_key_is_accepted() -> None:
    key = "a:" + "x" * (MAX_KEY_LENGTH - 2)
    assert normalize_key(key) == key


def test_key_name_is_the_part_before_the_first_colon() -> None:
    assert key_name("account:7") == "account"
    assert key_name("s3:bucket:path") == "s3"
    assert key_name("stripe") == "stripe"


@pytest.mark.parametrize("name", ["", "a:b", 7, None, "1abc", "x" * 65])
def test_validate_name_rejects(name: object) -> None:
    with pytest.raises(InvalidKey):
        validate_name(name)


def test_a_call_takes_at_most_max_keys_per_call_keys_from_the_producer_and_from_a_header() -> None:
    """Each key is a row lock in the admission's transaction: a foreign header listing thousands of keys would hold the
    worker's admission thread for seconds (5,000 took 7.7 s), so both the producer and the worker refuse more."""
    from celery import Celery

    from celery_keyed import keyed_task
    from celery_keyed.ledger import MAX_KEYS_PER_CALL
    from celery_keyed.worker.intake import header_keys

    app = Celery("keys-unit", set_as_current=False)

    @keyed_task(app=app, concurrency_key="acct:{acct}")
    def one(acct: int) -> None: ...

    most = [f"k:{i}" for i in range(MAX_KEYS_PER_CALL)]
    assert one.keyed_headers((1,), {}, {"concurrency_key": most})["keyed_key"] == most
    with pytest.raises(InvalidKey, match=f"lists {MAX_KEYS_PER_CALL + 1} keys; a call takes at most"):
        one.keyed_headers((1,), {}, {"concurrency_key": [*most, "k:x"]})
    assert header_keys(most) == most
    with pytest.raises(InvalidKey, match=f"lists 5000 keys; a call takes at most {MAX_KEYS_PER_CALL}"):
        header_keys([f"k:{i}" for i in range(5000)])


@pytest.mark.parametrize(
    ("task_id", "message"),
    [
        ("x" * 256, "256 characters; the ledger takes at most 255"),
        ("a\x00b", "NUL"),
        ("a\ud800", "lone surrogate"),
        ("", "non-empty str"),
        (7, "non-empty str"),
    ],
)
def test_a_task_id_the_ledger_cannot_store_is_refused(task_id: object, message: str) -> None:
    from celery_keyed.ledger import validate_task_id

    with pytest.raises(InvalidKey, match=re.escape(message)):
        validate_task_id(task_id)


def test_task_ids_celery_and_users_make_are_accepted() -> None:
    from celery_keyed.ledger import validate_task_id

    for task_id in ("d3b07384-d9a7-4f3c-8d2b-1f0e2a3b4c5d", "report:user-7:2026-12-03", "é" * 255):
        validate_task_id(task_id)


@pytest.mark.parametrize(
    "timelimit",
    [["x", "y"], "ab", [1, 2, 3], [1], [-1, None], [float("nan"), None], [None, float("inf")], [2**2000, 1], [True, 1]],
)
def test_a_timelimit_header_celerys_pool_cannot_use_is_refused(timelimit: object) -> None:
    from types import SimpleNamespace

    from celery_keyed.worker.intake import check_time_limits

    with pytest.raises(InvalidKey, match="header timelimit must be"):
        check_time_limits(SimpleNamespace(_request_dict={"timelimit": timelimit}))


@pytest.mark.parametrize("timelimit", [None, [], [None, None], [30, 20], [0, 1.5], (10, None)])
def test_timelimit_headers_celery_sends_are_accepted(timelimit: object) -> None:
    from types import SimpleNamespace

    from celery_keyed.worker.intake import check_time_limits

    check_time_limits(SimpleNamespace(_request_dict={"timelimit": timelimit}))


def _celery_message(protocol: int) -> tuple[object, object]:
    """A message as Celery's own producer builds it (``app.amqp.as_task_v1`` / ``as_task_v2``), and the body the
    consumer hands the strategy (None for protocol 2, whose body the strategy decodes itself)."""
    from types import SimpleNamespace

    from celery import Celery

    app = Celery("guard-unit", set_as_current=False)
    build = app.amqp.as_task_v2 if protocol == 2 else app.amqp.as_task_v1
    msg = build("t-1", "proj.add", args=(1, 2), kwargs={"z": 3}, countdown=5, time_limit=30, soft_time_limit=20)
    if protocol == 2:
        return SimpleNamespace(headers=msg.headers, payload=msg.body), None
    return SimpleNamespace(headers=msg.headers, payload=msg.body), msg.body


@pytest.mark.parametrize("protocol", [1, 2])
def test_the_message_guard_passes_what_celery_sends(protocol: int) -> None:
    from celery_keyed.worker.intake import check_message

    message, body = _celery_message(protocol)
    check_message(message, body)


def test_the_message_guard_passes_celerys_hybrid_messages() -> None:
    """Protocol 2 headers with a protocol 1 body: Celery's strategy takes it (``hybrid_to_proto2``)."""
    from types import SimpleNamespace

    from celery_keyed.worker.intake import check_message

    check_message(SimpleNamespace(headers={"task": "proj.add", "id": "t-1"}, payload={"args": [1], "kwargs": {}}), None)


@pytest.mark.parametrize(
    ("headers", "payload"),
    [
        ({"task": "t", "id": "t-1"}, [[1]]),
        ({"task": "t", "id": "t-1"}, 5),
        ({"task": "t", "id": "t-1"}, "my args"),
        ({"task": "t", "id": "t-1"}, ["args", {}, {}]),
        ({"task": "t", "id": "t-1"}, {"which": 1}),
        ({"task": "t", "id": "t-1"}, {"args": [1], "kwargs": [2]}),
        ({"task": "t", "id": ["a"]}, [[1], {}, {}]),
        ({"task": "t"}, [[1], {}, {}]),
        ({"task": "t", "id": "t-1", "timelimit": ["x", "y"]}, [[1], {}, {}]),
    ],
)
def test_the_message_guard_refuses_what_celerys_strategy_would_die_on(headers: dict, payload: object) -> None:
    from types import SimpleNamespace

    from celery.exceptions import InvalidTaskError

    from celery_keyed.worker.intake import check_message

    with pytest.raises(InvalidTaskError, match="malformed task message"):
        check_message(SimpleNamespace(headers=headers, payload=payload), None)


def test_a_keyed_call_with_a_task_id_the_ledger_cannot_store_is_refused_at_the_producer() -> None:
    from celery import Celery

    from celery_keyed import keyed_task

    app = Celery("task-id-unit", broker="memory://", set_as_current=False)

    @keyed_task(app=app, concurrency_key="acct:{acct}")
    def one(acct: int) -> None: ...

    with pytest.raises(InvalidKey, match="the ledger takes at most 255"):
        one.apply_async((1,), task_id="x" * 256)
    with pytest.raises(InvalidKey, match="NUL"):
        one.s(1).apply_async(task_id="a\x00b")
