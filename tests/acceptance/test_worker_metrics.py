"""Metrics from a real worker: its ``keyed_metrics_port`` endpoint serves the ledger gauges while tasks run and
wait, and its admission counters and handoff histogram move as it admits, parks and hands off."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.acceptance.conftest import ROOT, Cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def start_metrics_worker(cluster: Cluster, name: str, port: int) -> None:
    log = cluster.tmp / f"{name}.log"
    cluster.logs[name] = log
    cmd = [
        sys.executable, "-m", "celery", "-A", "tests.acceptance.metrics_proj", "worker", "-P", "prefork", "-c", "2",
        "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
    ]  # fmt: skip
    env = {**cluster.env, "KEYED_METRICS_PORT": str(port)}
    with open(log, "wb") as out:
        cluster.workers[name] = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster.wait_ready(name)


@pytest.mark.parametrize("cluster", [{}], indirect=True)
def test_worker_serves_gauges_and_counters_move(cluster: Cluster, producer) -> None:
    port = free_port()
    start_metrics_worker(cluster, "w1", port)
    for i in range(4):  # one key, K = 1 (unconfigured): one runs, the others park and are handed off in turn
        producer.hold.delay("m:1", 0.6, note=str(i))
    cluster.wait_for("SELECT coalesce(sum(waiting), 0) >= 1 FROM keyed_keys WHERE key = 'm:1'", True, timeout=30)
    cluster.wait_for("SELECT count(*) >= 1 FROM observed WHERE kind = 'start'", True, timeout=30)
    during = scrape(port)
    assert during[("celery_keyed_ledger_up", ())] == 1
    assert during[("celery_keyed_in_flight", (("name", "m"),))] == 1
    assert during[("celery_keyed_waiting", (("name", "m"),))] >= 1
    assert during[("celery_keyed_oldest_waiting_seconds", (("name", "m"),))] > 0
    assert during[("celery_keyed_limit", (("name", "m"), ("source", "default")))] == 1

    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 4, timeout=60)
    deadline = time.monotonic() + 10
    while True:  # the last release lands just after the last task's end row
        after = scrape(port)
        if after[("celery_keyed_in_flight", (("name", "m"),))] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    total = "celery_keyed_admissions_total"
    admissions = {dict(labels)["outcome"]: value for (name, labels), value in after.items() if name == total}
    assert admissions.get("admitted", 0) >= 1
    assert admissions.get("parked", 0) >= 2
    assert admissions.get("promoted", 0) >= 2  # the parked ones started on handed-off slots
    assert admissions["admitted"] + admissions["promoted"] == 4  # every task started exactly once
    handoffs = after[("celery_keyed_handoff_seconds_count", ())]
    assert handoffs >= 2  # released here, started here (local handoff, D4)
    assert 0 < after[("celery_keyed_handoff_seconds_sum", ())] / handoffs < 1.0
    assert after[("celery_keyed_in_flight", (("name", "m"),))] == 0
    assert after[("celery_keyed_waiting", (("name", "m"),))] == 0
