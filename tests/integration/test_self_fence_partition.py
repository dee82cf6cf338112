"""The self-fence against a real PostgreSQL behind a network that goes silent (``SilentProxy``), no worker: the
gate's heartbeat blocks in a renewal that never returns (no client-side timeout ends it), and the self-fence's own
timer still stops the attempt before the lease the database counts could lapse (D19)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from types import SimpleNamespace

import sqlalchemy as sa
from celery import Celery
from sqlalchemy.engine import make_url

from celery_keyed.gate import GateService, Running
from celery_keyed.ledger import Arrival, Token
from celery_keyed.partition import SilentProxy
from celery_keyed.settings import read_settings

LEASE = 6.0  # heartbeat and margin 1 s


def test_the_fence_stops_an_attempt_while_its_renewal_waits_on_a_silent_server(
    database_url: str, engine: sa.Engine
) -> None:
    url = make_url(database_url)
    assert url.host and url.port
    child = subprocess.Popen(["sleep", "120"])  # stands in for the pool process running the body
    with SilentProxy(url.host, url.port, lifetime=120.0) as proxy:
        app = Celery("fence-test", broker="memory://", set_as_current=False)
        app.conf.update(keyed_database_url=proxy.url_for(database_url), keyed_lease=LEASE, keyed_connect_timeout=600)
        consumer = SimpleNamespace(hostname="fence-test", timer=None, strategies={}, pool=None)
        gate = GateService(app, consumer, read_settings(app.conf))
        heartbeat = gate.heartbeat
        heartbeat.can_terminate = lambda: True  # type: ignore[method-assign]  # as on prefork
        killed_at: list[float] = []
        terminate = heartbeat.fence.terminate

        def recording(entry: Running, why: str) -> bool:
            killed_at.append(time.time())
            return terminate(entry, why)

        heartbeat.fence.terminate = recording
        try:
            sent = time.monotonic()
            admission = gate.ledger.admit(Arrival("body", key="k:1"))
            token = Token("body", 0)
            request = SimpleNamespace(
                name="t", keyed_started=True, keyed_claim=(token, admission.fence), keyed_arrival_key="k:1",
                worker_pid=child.pid, keyed_fenced=None, keyed_cancelled=None,
            )
            gate.running[token] = Running(request, token, admission.fence, lease_from=sent)
            heartbeat.start()
            deadline = time.monotonic() + 60
            while heartbeat.last_renewal <= sent:  # one renewal went through the proxy
                assert time.monotonic() < deadline
                time.sleep(0.05)
            renewed = heartbeat.last_renewal
            proxy.silence()
            assert child.wait(timeout=60) == -signal.SIGKILL
            assert heartbeat.last_renewal == renewed  # no renewal returned: the heartbeat is still waiting
            assert request.keyed_fenced is not None
            with engine.connect() as conn:
                expires = conn.execute(
                    sa.text("SELECT extract(epoch FROM lease_expires_at) FROM keyed_claims WHERE task_id = 'body'")
                ).scalar_one()
            (at,) = killed_at
            assert at < float(expires), "the body was stopped after its lease had lapsed"
        finally:
            heartbeat.fence.stop()
            proxy.heal()  # the blocked renewal fails now, and the heartbeat can end
            gate.close()
            gate.engine.dispose()
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.wait()
