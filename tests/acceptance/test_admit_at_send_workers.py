"""Refusal at send with real workers (issue 14 item 3): a keyed task with ``admit_at_send`` is refused in the
producer's process, before any broker message, when its key's waiting room (counting the sends not arrived yet) is
full or its dedupe key is live; accepted sends run as usual and the books balance."""

from __future__ import annotations

import pytest
import redis

from celery_keyed import KeyedRejected
from celery_keyed.ledger import Ledger, parse_limits
from tests.acceptance.conftest import Cluster

LIMITS = {"feed": {"limit": 1, "max_waiting": 2}}


def _queued(cluster: Cluster) -> int:
    client = redis.Redis.from_url(cluster.broker_url)
    try:
        return int(client.llen("celery"))
    finally:
        client.close()


@pytest.mark.parametrize("cluster", [LIMITS], indirect=True)
def test_room_full_refused_at_send_no_message(cluster: Cluster, producer) -> None:
    """No worker yet: two sends take the room of feed:1 (max_waiting 2), the next three raise KeyedRejected and
    publish nothing; a worker then runs the two, one at a time, and the books hold exactly them. The room is the
    configuration stored in the ledger (what every worker syncs at start): stored here as a worker would."""
    Ledger(cluster.engine).configure(parse_limits(LIMITS))
    accepted = [producer.feed.delay("feed:1", 0.3) for _ in range(2)]
    for _ in range(3):
        with pytest.raises(KeyedRejected) as refused:
            producer.feed.delay("feed:1", 0.3)
        assert refused.value.reason == "room_full"
    assert _queued(cluster) == 2  # the refused sends never reached the broker
    cluster.start_worker("w1", concurrency=2)
    assert [r.get(timeout=30) for r in accepted] == ["feed:1", "feed:1"]
    # a running task takes no place: with one running, two more are accepted, the next is refused
    cluster.wait_for("SELECT count(*) FROM keyed_claims", 0)
    again = [producer.feed.delay("feed:1", 1.5)]
    cluster.wait_for("SELECT count(*) FROM keyed_claims WHERE state = 'running'", 1)
    again += [producer.feed.delay("feed:1", 0.1) for _ in range(2)]
    with pytest.raises(KeyedRejected):
        producer.feed.delay("feed:1", 0.1)
    assert [r.get(timeout=30) for r in again] == ["feed:1"] * 3
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome IS NULL", 0)  # releases book after the result
    books = dict(cluster.rows("SELECT outcome, count(*) FROM keyed_tasks GROUP BY outcome"))
    assert books == {"completed": 5}
    assert cluster.scalar("SELECT sum(refused) FROM keyed_send_refusals WHERE reason = 'room_full'") == 4


@pytest.mark.parametrize("cluster", [{"feed": 5}], indirect=True)
def test_dedupe_key_one_live_task(cluster: Cluster, producer) -> None:
    cluster.start_worker("w1", concurrency=2)
    first = producer.feed.delay("feed:a", 1.0, dedupe="order:7")
    with pytest.raises(KeyedRejected) as refused:
        producer.feed.delay("feed:b", 0.1, dedupe="order:7")  # another key, same dedupe key: refused
    assert (refused.value.reason, refused.value.holder_task_id) == ("duplicate", first.id)
    other = producer.feed.delay("feed:b", 0.1, dedupe="order:8")
    assert first.get(timeout=30) == "order:7" and other.get(timeout=30) == "order:8"
    cluster.wait_for("SELECT count(*) FROM keyed_tasks WHERE outcome = 'completed'", 2)
    assert producer.feed.delay("feed:a", 0.1, dedupe="order:7").get(timeout=30) == "order:7"  # the first is over
    assert cluster.scalar("SELECT count(*) FROM observed WHERE kind = 'start'") == 3
