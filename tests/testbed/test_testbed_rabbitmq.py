"""The test bed's RabbitMQ: a node of its own (ports, epmd, files), stopped by PID with its epmd, the vhost per
test of the ``amqp_url`` fixture, and the ``amqp://`` environment overrides."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from kombu import Connection

from celery_keyed import testing as testbed
from celery_keyed.testing import RabbitServer, TestbedError, start_rabbitmq
from celery_keyed.testing.servers import broker_from_env


def process_group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_gone(pgid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_group_gone(pgid):
            return True
        time.sleep(0.05)
    return False


def managed(server: testbed.RabbitTarget) -> RabbitServer:
    if not isinstance(server, RabbitServer):
        pytest.skip("the broker was not started by the test bed")
    return server


def roundtrip(url: str, payload: dict[str, int]) -> dict[str, int]:
    with Connection(url) as conn:
        queue = conn.SimpleQueue("roundtrip")
        try:
            queue.put(payload)
            message = queue.get(timeout=5)
            message.ack()
            return dict(message.payload)
        finally:
            queue.close()


def listening(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


_vhosts_seen: list[str] = []


def test_session_node_has_its_own_ports_and_files(rabbitmq_server: testbed.RabbitTarget) -> None:
    server = managed(rabbitmq_server)
    assert server.pid is not None and server.epmd_pid is not None
    assert len({server.port, server.dist_port, server.epmd_port}) == 3
    assert 4369 not in (server.epmd_port, server.dist_port) and server.port != 5672
    assert server.url == f"amqp://guest:guest@127.0.0.1:{server.port}/%2F"
    for port in (server.port, server.dist_port, server.epmd_port):
        assert listening(port), port
    assert server.nodename.startswith("keyed-") and server.nodename.endswith("@localhost")
    assert (Path(server.tmpdir) / "mnesia" / server.nodename).is_dir()
    assert str(server.tmpdir) in server.ctl("eval", "rabbit_mnesia:dir().")  # RABBITMQ_MNESIA_BASE honoured


def test_amqp_url_is_a_vhost_of_its_own(amqp_url: str, rabbitmq_server: testbed.RabbitTarget) -> None:
    server = managed(rabbitmq_server)
    vhost = amqp_url.rsplit("/", 1)[1]
    assert vhost and vhost != "%2F"
    assert roundtrip(amqp_url, {"n": 1}) == {"n": 1}
    with Connection(server.url) as conn:  # the default vhost does not see the test's queue
        channel = conn.default_channel
        with pytest.raises(Exception, match="NOT_FOUND"):
            channel.queue_declare("roundtrip", passive=True)
    _vhosts_seen.append(vhost)  # the next test checks it was deleted


def test_previous_tests_vhost_was_deleted(rabbitmq_server: testbed.RabbitTarget) -> None:
    server = managed(rabbitmq_server)
    if not _vhosts_seen:
        pytest.skip("run together with test_amqp_url_is_a_vhost_of_its_own")
    assert _vhosts_seen[-1] not in server.ctl("list_vhosts", "name").split()


def fresh_node() -> RabbitServer:
    if not os.path.exists(testbed.RABBITMQ_SCRIPTS / "rabbitmq-server") and not os.environ.get("CI"):
        pytest.skip("RabbitMQ is not installed")
    server = start_rabbitmq(use_env=False)
    assert isinstance(server, RabbitServer)
    return server


def test_stop_kills_the_node_and_its_epmd() -> None:
    server = fresh_node()
    tmpdir = server.tmpdir
    pid, epmd = server.pid, server.epmd_pid
    assert pid is not None and epmd is not None
    assert roundtrip(server.url, {"n": 1}) == {"n": 1}
    server.stop()
    assert wait_gone(pid), "the node outlived stop()"
    assert wait_gone(epmd), "our epmd outlived stop()"
    assert not tmpdir.exists()
    assert server.pid is None and server.epmd_pid is None
    server.stop()  # twice is fine
    with pytest.raises(TestbedError, match="stopped for good"):
        server.restart()


@pytest.mark.slow
def test_restart_keeps_durable_queues_and_persistent_messages() -> None:
    server = fresh_node()
    try:
        url = server.add_vhost("persist")
        with Connection(url) as conn:
            queue = conn.SimpleQueue("kept")
            queue.put({"kept": 1})
            queue.close()
        pid, epmd = server.pid, server.epmd_pid
        assert pid is not None and epmd is not None
        server.restart()
        assert wait_gone(pid) and wait_gone(epmd)
        assert server.pid not in (None, pid) and server.epmd_pid not in (None, epmd)
        with Connection(url) as conn:
            queue = conn.SimpleQueue("kept")
            assert queue.get(timeout=5).payload == {"kept": 1}
            queue.close()
    finally:
        server.stop()


def test_amqp_env_overrides(monkeypatch: pytest.MonkeyPatch, redis_server: testbed.RedisTarget) -> None:
    monkeypatch.delenv(testbed.AMQP_URL_ENV, raising=False)
    monkeypatch.setenv(testbed.BROKER_URL_ENV, "amqp://u:p@rabbit.invalid:5673/prod?heartbeat=10")
    rabbit = start_rabbitmq()
    assert isinstance(rabbit, testbed.ExternalRabbit) and not rabbit.managed and rabbit.pid is None
    assert rabbit.url_for("t 1") == "amqp://u:p@rabbit.invalid:5673/t%201?heartbeat=10"
    with pytest.raises(TestbedError):
        rabbit.add_vhost("x")
    rabbit.stop()  # nothing to stop
    # an amqp:// CELERY_BROKER_URL is RabbitMQ's: start_redis does not wrap it as a Redis
    assert broker_from_env(amqp=False) is None
    monkeypatch.setenv(testbed.BROKER_URL_ENV, redis_server.url)
    assert broker_from_env(amqp=True) is None
    assert isinstance(testbed.start_redis(), testbed.ExternalRedis)
    # KEYED_AMQP_URL names a RabbitMQ while CELERY_BROKER_URL names the Redis
    monkeypatch.setenv(testbed.AMQP_URL_ENV, "amqp://guest:guest@127.0.0.1:5999//")
    assert start_rabbitmq().url == "amqp://guest:guest@127.0.0.1:5999//"
