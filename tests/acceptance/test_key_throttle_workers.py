"""A key that throttles itself, with real workers (issue 14 item 4): two prefork workers, real Redis, real Postgres and
the independent observer (the ``observed`` table the tasks write). A task that gets a 429 pauses its own key: no
other task of that key starts before the pause ends, other keys of the same name keep running, the key's waiting
tasks keep their order and are woken by the sweepers when it ends (nothing else happens on that key). A task that
reads a vendor's concurrency header sets its key's limit: that key runs one at a time while another key of the
name runs up to the name's limit. The bound holds and the books balance."""

from __future__ import annotations

from datetime import datetime

import pytest

from tests.acceptance.conftest import Cluster, peak_overlap


@pytest.mark.parametrize("cluster", [{"api": 2}], indirect=True)
def test_a_task_pauses_its_own_key_until_retry_after(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    cluster.start_worker("w2", concurrency=2)
    pauser = producer.vendor_call.delay("api:a", 0.2, note="429", retry_after=4.0).id
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'paused'", 1, timeout=30)
    on_a = [producer.vendor_call.delay("api:a", 0.2, note=f"a{i}").id for i in range(4)]
    on_b = [producer.vendor_call.delay("api:b", 0.5, note=f"b{i}").id for i in range(6)]
    # Every task of the paused key parks (the pauser's own end made room: still nothing starts).
    cluster.wait_for("SELECT count(*) FROM keyed_waiting WHERE key = 'api:a'", 4, timeout=30)
    line = [r.task_id for r in cluster.rows(
        "SELECT task_id FROM keyed_waiting WHERE key = 'api:a' ORDER BY priority DESC, arrival")]
    assert sorted(line) == sorted(on_a)
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 11, timeout=60)

    paused_until = datetime.fromisoformat(cluster.scalar("SELECT note FROM observed WHERE kind = 'paused'")).timestamp()
    spans = {t: (s, e) for t, s, e in cluster.intervals()}
    early = [t for t in on_a if spans[t][0] < paused_until]
    assert early == [], f"tasks of the paused key started before its pause ended: {early}"
    assert any(spans[t][0] < paused_until for t in on_b), "the other key of the name ran during the pause"
    assert peak_overlap(cluster.intervals("api:a")) <= 2 and peak_overlap(cluster.intervals("api:b")) <= 2
    # Woken in their order (D10): the ledger's claims (fences) follow the line.
    fences = dict(cluster.rows("SELECT task_id, fence FROM observed WHERE kind = 'start' AND key = 'api:a'"))
    assert sorted(on_a, key=lambda t: fences[t]) == line
    assert spans[pauser][0] < paused_until
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    cluster.wait_for("SELECT coalesce(sum(used), 0) FROM keyed_slots", 0)
    cluster.wait_for("SELECT count(*) FROM keyed_key_overrides", 0)  # the sweep cleared the pause it ended
    actions = [r.action for r in cluster.rows("SELECT action FROM keyed_override_log WHERE key = 'api:a' ORDER BY id")]
    assert actions == ["pause", "resume"]
    books = dict(cluster.rows("SELECT coalesce(outcome, 'open'), count(*) FROM keyed_tasks GROUP BY 1"))
    assert books == {"completed": 11}


@pytest.mark.parametrize("cluster", [{"api": 3}], indirect=True)
def test_a_task_sets_its_keys_limit_from_a_vendor_header(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=3)
    cluster.start_worker("w2", concurrency=3)
    producer.vendor_call.delay("api:c", 0.05, note="header", limit=1, limit_for=120).get(timeout=30)
    on_c = [producer.vendor_call.delay("api:c", 0.3, note=f"c{i}").id for i in range(6)]
    on_d = [producer.vendor_call.delay("api:d", 0.3, note=f"d{i}").id for i in range(6)]
    cluster.wait_for("SELECT count(*) FROM observed WHERE kind = 'end'", 13, timeout=60)
    assert peak_overlap(cluster.intervals("api:c")) == 1  # its own limit: one at a time
    peak_d = peak_overlap(cluster.intervals("api:d"))
    assert 2 <= peak_d <= 3, peak_d  # the name's limit for the other keys
    assert len(on_c) == len(on_d) == 6
    assert cluster.scalar("SELECT slot_limit FROM keyed_key_overrides WHERE key = 'api:c'") == 1
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    books = dict(cluster.rows("SELECT coalesce(outcome, 'open'), count(*) FROM keyed_tasks GROUP BY 1"))
    assert books == {"completed": 13}
