"""The outbox's options and its producer, without servers (issue 14 item 8): the setting and the per-name option are
True or False; the arrival timeout of a grouped task stays under half the group's; the record made at publish is the
record a received message gives, compressed bodies included; the producer stores only the task's own message."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from kombu.compression import compress
from kombu.message import Message

from celery_keyed.ledger import InvalidConfig, NameConfig, parse_limits
from celery_keyed.messages import record_message, record_published, restore_message
from celery_keyed.publisher import OutboxProducer, arrival_timeout
from celery_keyed.settings import read_settings

URL = "postgresql+psycopg://u@h/db"


def test_setting_default_and_values() -> None:
    assert read_settings({"keyed_database_url": URL}).register_at_publish is False
    assert read_settings({"keyed_database_url": URL, "keyed_register_at_publish": True}).register_at_publish


@pytest.mark.parametrize("value", ["yes", 1, "True"])
def test_setting_must_be_a_bool(value: object) -> None:
    with pytest.raises(InvalidConfig, match="keyed_register_at_publish"):
        read_settings({"keyed_database_url": URL, "keyed_register_at_publish": value})


def test_per_name_option() -> None:
    assert parse_limits({"sync": {"limit": 1, "register_at_publish": True}})["sync"].register_at_publish
    with pytest.raises(InvalidConfig, match="register_at_publish"):
        NameConfig("sync", register_at_publish="on")  # type: ignore[arg-type]


def test_grouped_tasks_are_due_before_their_number_is_lost() -> None:
    settings = read_settings({"keyed_database_url": URL, "keyed_group_arrival_timeout": 300})
    assert (arrival_timeout(settings, grouped=False), arrival_timeout(settings, grouped=True)) == (3600.0, 150.0)
    short = read_settings({"keyed_database_url": URL, "keyed_send_arrival_timeout": 30})
    assert arrival_timeout(short, grouped=True) == 30.0


@pytest.mark.parametrize("compression", [None, "zlib"])
def test_record_at_publish_is_the_record_at_receipt(compression: str | None) -> None:
    body = ((1, "a"), {"k": [1, 2]}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
    headers = {"id": "t1", "task": "proj.t", "keyed_key": "acct:1", "retries": 0}
    made = record_published(
        body, task_name="proj.t", exchange="", routing_key="celery", headers=headers, serializer="json",
        compression=compression, properties={"correlation_id": "t1", "reply_to": "r", "priority": 3,
                                             "delivery_mode": 2},
    )
    message = restore_message(made)
    assert message.decode() == [[1, "a"], {"k": [1, 2]}, body[2]] and not message.errors
    plain = base64.b64decode(made["body"])
    # the message as a worker receives it (kombu decompresses a compressed body when it builds it)
    sent_headers = dict(made["headers"])
    wire = plain
    if compression:
        wire, sent_headers["compression"] = compress(plain, compression)
    received = Message(
        body=wire, content_type=made["content_type"], content_encoding=made["content_encoding"],
        headers=sent_headers, properties={"correlation_id": "t1", "reply_to": "r", "priority": 3},
        delivery_info={"exchange": "", "routing_key": "celery"},
    )
    recorded = record_message(received, task_name="proj.t")
    assert recorded == made  # a parked copy and an outbox copy are the same record
    assert not restore_message(recorded).errors and restore_message(recorded).decode() == message.decode()


class _Producer:
    def __init__(self) -> None:
        self.published: list[tuple[Any, dict[str, Any]]] = []
        self.connection = "broker"

    def publish(self, body: Any, **kwargs: Any) -> str:
        self.published.append((body, kwargs))
        return "sent"


def test_the_producer_stores_only_the_tasks_own_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another message through the same producer (Celery's task-sent event, another task id) goes straight through
    without touching the ledger; attributes are the real producer's."""
    real = _Producer()
    producer = OutboxProducer(real, app=None, task_id="t1", task_name="proj.t")
    monkeypatch.setattr("celery_keyed.publisher.publisher_for", lambda *a, **k: pytest.fail("no ledger call"))
    assert producer.publish("event", headers={"id": "other"}) == "sent"
    assert producer.connection == "broker" and not producer.stored
    assert real.published == [("event", {"headers": {"id": "other"}})]
