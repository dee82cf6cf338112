"""Limits safe during rolling deploys with real workers (issue 14 item 7): a worker started with a newer
keyed_config_version stores its limits; one started after it with an older version and other limits keeps them,
says so in its log, and runs under the newer limit; each worker's version is in the ledger."""

from __future__ import annotations

import json

import pytest

from tests.acceptance.conftest import Cluster, peak_overlap


@pytest.mark.parametrize("cluster", [{"gate": 3}], indirect=True)
def test_older_worker_keeps_newer_limits(cluster: Cluster, producer) -> None:
    cluster.env["KEYED_CONFIG_VERSION"] = "2"
    cluster.start_worker("new", concurrency=3)
    cluster.env.update(KEYED_CONFIG_VERSION="1", KEYED_LIMITS=json.dumps({"gate": 1}))
    cluster.start_worker("old", concurrency=3)
    assert cluster.scalar("SELECT slot_limit FROM keyed_names WHERE name = 'gate'") == 3
    assert cluster.scalar("SELECT config_version FROM keyed_names WHERE name = 'gate'") == 2
    assert "runs configuration version 1, older than version 2" in cluster.logs["old"].read_text()
    assert "older than version" not in cluster.logs["new"].read_text()
    versions = {r.hostname.split("@")[0]: r.config_version for r in cluster.rows("SELECT * FROM keyed_holders")}
    assert versions == {"new": 2, "old": 1}
    for i in range(9):
        producer.hold.delay("gate:x", 0.4, note=str(i))
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 9, timeout=60)
    assert peak_overlap(cluster.intervals("gate:x")) == 3  # the newer limit, on both workers
