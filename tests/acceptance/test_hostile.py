"""Hostile input from a foreign producer (D16, issue 9 items 4, 7, 9): ``send_task`` from a process that does not
have the task module, with arguments and headers a careful producer would never send, through a real prefork
worker. The worker stays alive and keeps serving; every message ends with a recorded outcome in the books or
a body that ran, and with a result in the backend (a rejection is a ``KeyedRejected`` failure, D11)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_keyed.ledger import InvalidKey
from tests.acceptance.conftest import ROOT, Cluster, make_cluster, peak_overlap

LIMITS = {"lim": 2}
WAIT = 60.0


@pytest.fixture
def hostile_cluster(database_url: str, redis_url: str, tmp_path: Path) -> Iterator[Cluster]:
    yield from make_cluster(database_url, redis_url, tmp_path, LIMITS)


@pytest.fixture
def foreign(hostile_cluster: Cluster) -> Iterator[Celery]:
    """A producer that knows the task names only: no task module, no celery-keyed."""
    app = Celery("foreign", broker=hostile_cluster.broker_url, backend=hostile_cluster.broker_url, set_as_current=False)
    app.conf.task_publish_retry = False
    yield app
    app.close()


def start_worker(cluster: Cluster, name: str = "w1", concurrency: int = 4) -> Any:
    """A worker of tests.acceptance.hostile_proj (Cluster.start_worker runs tests.acceptance.proj)."""
    import subprocess

    log = cluster.tmp / f"{name}.log"
    cluster.logs[name] = log
    cmd = [
        sys.executable, "-m", "celery", "-A", "tests.acceptance.hostile_proj", "worker", "-P", "prefork",
        "-c", str(concurrency), "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-l", "INFO",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=cluster.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    cluster.workers[name] = proc
    cluster.wait_ready(name)
    return proc


def send(app: Celery, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> str:
    task_id = options.pop("task_id", None) or f"h-{uuid.uuid4().hex[:16]}"
    app.send_task(name, args=args, kwargs=kwargs, task_id=task_id, **options)
    return task_id


def settle(cluster: Cluster, app: Celery, ids: list[str], timeout: float = WAIT) -> dict[str, dict[str, Any]]:
    """Wait until every message has ended (a terminal outcome in the books, or a body that ran to its end)
    and has a result; return what each got. Fails (with the worker's log) if the worker died or time ran out."""
    deadline = time.monotonic() + timeout
    state: dict[str, dict[str, Any]] = {}
    while True:
        proc = cluster.workers["w1"]
        if proc.poll() is not None:
            raise AssertionError(f"the worker died ({proc.returncode}):\n{_log(cluster)}")
        books = {
            r.task_id: r.outcome
            for r in cluster.rows("SELECT task_id, outcome FROM keyed_tasks WHERE task_id = ANY(:ids)", ids=ids)
        }
        ran = {r.task_id for r in cluster.rows("SELECT task_id FROM observed WHERE kind = 'end'")}
        state = {}
        for task_id in ids:
            result = app.AsyncResult(task_id)
            state[task_id] = {
                "books": books.get(task_id, "no row"),
                "ran": task_id in ran,
                "result": result.state,
                "error": type(result.result).__name__ if result.state == "FAILURE" else None,
            }
        pending = {
            t: s
            for t, s in state.items()
            # ended: a final outcome in the books, or a body that ran with no books row (unkeyed); a keyed body
            # that ran is booked by its release, which runs just after its result is stored: wait for it
            if not (s["books"] not in ("no row", None) or (s["ran"] and s["books"] == "no row"))
            or s["result"] not in ("SUCCESS", "FAILURE")
        }
        if not pending:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(pending)} messages never ended: {list(pending.items())[:10]}\n{_log(cluster)}")
        time.sleep(0.2)


def _log(cluster: Cluster) -> str:
    return cluster.logs["w1"].read_text(errors="replace")[-6000:]


def assert_still_serving(cluster: Cluster, app: Celery) -> None:
    canary = send(app, "hostile.echo", args=[f"canary:{uuid.uuid4().hex[:6]}"])
    state = settle(cluster, app, [canary])[canary]
    assert state["ran"] and state["result"] == "SUCCESS" and state["books"] == "completed", state
    assert "Unrecoverable error" not in _log(cluster)


# -- The known poison messages (issue 9 items 4, 7, 9) ---------------------------------------------------------


POISON = {
    "key callable missing its argument": ("hostile.tenant", [], {}, {}),
    "format spec on a string": ("hostile.fmt", ["abc"], {}, {}),
    "key callable raising ZeroDivisionError": ("hostile.boom", [1], {}, {}),
    "retries = 2**31": ("hostile.limited", ["r"], {}, {"retries": 2**31}),
    "keyed_group_seq = 2**63": ("hostile.grouped", ["g", 1], {}, {"headers": {"keyed_group_seq": 2**63}}),
    "keyed_group_seq = -2**63 - 1": ("hostile.grouped", ["g2", 1], {}, {"headers": {"keyed_group_seq": -(2**63) - 1}}),
    "keyed_cost = 2**40": ("hostile.limited", ["c"], {}, {"headers": {"keyed_cost": 2**40}}),
    # a row lock each in one transaction: thousands would hold the admission thread for seconds (MAX_KEYS_PER_CALL)
    # Celery's own header, read by its pool on the consumer loop: ["x", "y"] reached kombu's timer and killed the worker
    "timelimit = ['x', 'y']": ("hostile.limited", ["t1"], {}, {"headers": {"timelimit": ["x", "y"]}}),
    "timelimit = 'ab'": ("hostile.limited", ["t2"], {}, {"headers": {"timelimit": "ab"}}),
    "timelimit = [1, 2, 3]": ("hostile.echo", ["acct:t3"], {}, {"headers": {"timelimit": [1, 2, 3]}}),
    "keyed_key lists 5,000 keys":
        ("hostile.limited", ["m"], {}, {"headers": {"keyed_key": [f"m:{i}" for i in range(5000)]}}),
}  # fmt: skip

#: Messages whose keys cannot be computed at all: a recorded rejection with a KeyedRejected result (D16).
MUST_REJECT = {
    "key callable missing its argument",
    "format spec on a string",
    "key callable raising ZeroDivisionError",
    "keyed_key lists 5,000 keys",
    "timelimit = ['x', 'y']",
    "timelimit = 'ab'",
    "timelimit = [1, 2, 3]",
}


def test_poison_messages_get_an_outcome_and_the_worker_survives(hostile_cluster: Cluster, foreign: Celery) -> None:
    cluster = hostile_cluster
    start_worker(cluster)
    ids = {}
    for label, (name, args, kwargs, options) in POISON.items():
        ids[label] = send(foreign, name, args=args, kwargs=kwargs, **options)
    state = settle(cluster, foreign, list(ids.values()))
    for label in MUST_REJECT:
        got = state[ids[label]]
        assert got["books"] == "rejected" and got["result"] == "FAILURE" and got["error"] == "KeyedRejected", (
            label,
            got,
        )
        assert not got["ran"], (label, got)
    assert_still_serving(cluster, foreign)


def test_a_null_key_header_is_still_gated(hostile_cluster: Cluster, foreign: Celery) -> None:
    """``keyed_key: None`` (present but null) must not bypass the gate: the key is computed from the arguments
    (found: 4 ran at once under a limit of 2, and the ledger never saw them)."""
    cluster = hostile_cluster
    start_worker(cluster, concurrency=4)
    ids = [send(foreign, "hostile.limited", args=["n", 1.0], headers={"keyed_key": None}) for _ in range(4)]
    state = settle(cluster, foreign, ids)
    assert all(s["books"] == "completed" and s["result"] == "SUCCESS" for s in state.values()), state
    assert peak_overlap(cluster.intervals("lim:n")) <= LIMITS["lim"]


# -- Generated input ---------------------------------------------------------------------------------------


GATE_HEADERS = [
    "keyed_key", "keyed_group", "keyed_group_seq", "keyed_supersede", "keyed_nonce", "keyed_cost", "keyed_fair",
    "keyed_fence", "keyed_fair_weight", "retries",
]  # fmt: skip
TASKS = ["hostile.tenant", "hostile.fmt", "hostile.boom", "hostile.echo", "hostile.limited", "hostile.grouped"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**31, 2**31 - 1, -(2**31) - 1, 2**63, 2**63 - 1, -(2**63) - 1, 10**12, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.inf, -math.inf, 1e300, -0.0]),
    st.text(max_size=12),
    st.sampled_from(
        ["", ":", "lim:", ":x", "a" * 300, "lim:" + "x" * 600, "\x00", "é:ü", "{n}", "fmt:{", "lim:\ud800"]
    ),
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(st.text(max_size=5), scalars, max_size=3))
messages = st.tuples(
    st.sampled_from(TASKS),
    st.lists(values, max_size=3),
    st.dictionaries(
        st.sampled_from(["key", "n", "tenant_id", "which", "seconds", "group", "seq", "x"]), values, max_size=2
    ),
    st.dictionaries(st.sampled_from(GATE_HEADERS), values, max_size=4),
)


@pytest.mark.timeout(240)
def test_generated_headers_and_arguments_never_kill_the_worker(hostile_cluster: Cluster, foreign: Celery) -> None:
    cluster = hostile_cluster
    start_worker(cluster)
    sent: list[str] = []

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(messages)
    def publish(message: tuple[str, list[Any], dict[str, Any], dict[str, Any]]) -> None:
        name, args, kwargs, headers = message
        retries = headers.pop("retries", None)
        options: dict[str, Any] = {"headers": headers}
        if retries is not None:
            options["retries"] = retries
        # The producer's own serializer may refuse a message: it never reaches a worker then.
        with contextlib.suppress(Exception):
            sent.append(send(foreign, name, args=args, kwargs=kwargs, **options))

    publish()
    assert len(sent) > 40
    state = settle(cluster, foreign, sent, timeout=120)
    for task_id, got in state.items():
        if got["books"] == "rejected":
            assert got["result"] == "FAILURE" and got["error"] == "KeyedRejected", (task_id, got)
        assert got["books"] != "no row" or got["ran"], (task_id, got)  # keyed: the ledger saw it
    assert_still_serving(cluster, foreign)


#: Text PostgreSQL cannot store, from a foreign producer's JSON: a lone UTF-16 surrogate ("\ud800" decodes to one in
#: Python and has no UTF-8 form) and a NUL byte (refused in a text column), wherever the gate reads text: keys
#: computed from the arguments, the key headers, the task id. Each is a recorded rejection with a KeyedRejected
#: result, whether or not the attempt would have parked (before, a NUL in the supersede header ran, because it
#: reached the database only when the attempt parked).
UNSTORABLE = {
    "lone surrogate in a key from the arguments": ("hostile.echo", ["acct:\ud800"], {}, {}),
    "lone surrogate in the key header": ("hostile.limited", ["s"], {}, {"headers": {"keyed_key": "lim:\ud800"}}),
    "lone surrogate in the group header": ("hostile.grouped", ["g"], {}, {"headers": {"keyed_group": "grp:\udfff"}}),
    "lone surrogate in a group from the arguments": ("hostile.grouped", ["\ud834"], {}, {}),
    "NUL in the supersede header":
        ("hostile.limited", ["u"], {}, {"headers": {"keyed_key": "lim:u", "keyed_supersede": "a:\x00b"}}),
    "lone surrogate in the supersede header":
        ("hostile.limited", ["v"], {}, {"headers": {"keyed_key": "lim:v", "keyed_supersede": "a:\ud800"}}),
    "lone surrogate in the fair header":
        ("hostile.limited", ["w"], {}, {"headers": {"keyed_key": "lim:w", "keyed_fair": "t:\ud800"}}),
}  # fmt: skip


def test_text_postgres_cannot_store_is_a_rejection_and_the_worker_serves_on(
    hostile_cluster: Cluster, foreign: Celery
) -> None:
    cluster = hostile_cluster
    start_worker(cluster)
    ids = {label: send(foreign, name, args=a, kwargs=k, **o) for label, (name, a, k, o) in UNSTORABLE.items()}
    state = settle(cluster, foreign, list(ids.values()))
    for label, task_id in ids.items():
        got = state[task_id]
        assert got["books"] == "rejected" and got["error"] == "KeyedRejected" and not got["ran"], (label, got)
    # Task ids the ledger cannot store (a NUL; 8,000 incompressible characters, over PostgreSQL's index row size, which
    # had every admission of the message fail as if the database were down, holding the worker's keyed intake): they
    # cannot be booked at all, their results are still KeyedRejected failures, they never run, nothing stalls.
    import secrets

    for n, task_id in enumerate(["h-nul\x00id", "h-" + secrets.token_hex(4000)]):
        send(foreign, "hostile.limited", args=[f"i{n}"], task_id=task_id)
        result = foreign.AsyncResult(task_id)
        deadline = time.monotonic() + WAIT
        while result.state not in ("SUCCESS", "FAILURE"):
            assert time.monotonic() < deadline and cluster.workers["w1"].poll() is None, _log(cluster)
            time.sleep(0.1)
        assert result.state == "FAILURE" and type(result.result).__name__ == "KeyedRejected", result.state
        assert cluster.scalar("SELECT count(*) FROM observed WHERE key = :k", k=f"lim:i{n}") == 0
    assert "unreachable" not in _log(cluster)
    assert_still_serving(cluster, foreign)


def _publish_raw(url: str, headers: dict[str, Any], body: Any) -> None:
    """A message as a foreign client could put it on the broker: any headers, any body, no Celery in between."""
    import json

    from kombu import Connection, Exchange, Producer

    with Connection(url) as conn:
        producer = Producer(conn.default_channel, exchange=Exchange("celery", type="direct"), routing_key="celery")
        producer.publish(
            json.dumps(body), headers=headers, content_type="application/json", content_encoding="utf-8",
            routing_key="celery",
        )  # fmt: skip


def _task_headers(task_id: Any, **extra: Any) -> dict[str, Any]:
    headers = {
        "lang": "py", "task": "hostile.limited", "id": task_id, "root_id": None, "parent_id": None, "group": None,
        "retries": 0, "timelimit": [None, None], "eta": None, "expires": None, "argsrepr": "", "kwargsrepr": "",
    }  # fmt: skip
    headers.update(extra)
    return {k: v for k, v in headers.items() if v is not _ABSENT}


_ABSENT = object()


def test_messages_not_shaped_as_task_messages_are_rejected_and_kill_no_worker(
    hostile_cluster: Cluster, foreign: Celery
) -> None:
    """A body that is not [args, kwargs, embed], a task id that is not a string, a timelimit of strings: each raised
    out of Celery's own strategy or request constructor on the consumer loop, and the worker died ("Unrecoverable
    error"); the message, restored unacked, killed the next worker too. Now each is an invalid task message, logged
    and rejected as Celery rejects one, for any task; a keyed task's with a task id to record it under has a
    KeyedRejected result and the books say rejected. A protocol-1 message of a keyed task is still gated and runs."""
    cluster = hostile_cluster
    start_worker(cluster)
    with_ids = {
        "a body that is a dict": ("r-dict", {"which": "d"}),
        "a body of [args] only": ("r-args-only", [["o"]]),
        "a body of [args, kwargs]": ("r-two", [["t"], {}]),
        "a body that is a number": ("r-number", 5),
        "a body that is a string with 'args' in it": ("r-str", "my args"),
        "a body listing 'args'": ("r-list", ["args", {}, {}]),
        "a hybrid body whose kwargs is a list": ("r-hybrid", {"args": ["h"], "kwargs": [1]}),
        "a timelimit of strings": ("r-limit", [["l"], {}, {}]),
    }
    for task_id, body in with_ids.values():
        extra = {"timelimit": ["x", "y"]} if task_id == "r-limit" else {}
        _publish_raw(cluster.broker_url, _task_headers(task_id, **extra), body)
    without = {"no id": _ABSENT, "an int id": 12345, "a list id": ["a"], "an empty id": ""}
    for n, task_id in enumerate(without.values()):
        _publish_raw(cluster.broker_url, _task_headers(task_id), [[f"x{n}"], {}, {}])
    # a plain task's too: Celery's own strategy would die on it the same way
    _publish_raw(cluster.broker_url, _task_headers("r-plain", task="acceptance.ping"), [["p"]])
    _publish_raw(cluster.broker_url, {}, {"task": "hostile.limited", "id": "r-proto1", "args": ["p1"], "kwargs": {}})
    state = settle(cluster, foreign, [*(i for i, _ in with_ids.values()), "r-proto1"])
    for label, (task_id, _) in with_ids.items():
        got = state[task_id]
        assert got["books"] == "rejected" and got["error"] == "KeyedRejected" and not got["ran"], (label, got)
    assert state["r-proto1"]["books"] == "completed" and state["r-proto1"]["ran"], state["r-proto1"]
    assert_still_serving(cluster, foreign)
    assert cluster.scalar("SELECT count(*) FROM observed WHERE key LIKE 'lim:x%'") == 0  # none without an id ran
    assert cluster.workers["w1"].poll() is None
    assert foreign.AsyncResult("r-plain").state == "PENDING"  # rejected as Celery rejects an invalid message
    log = cluster.logs["w1"].read_text(errors="replace")
    assert log.count("malformed task message") >= len(with_ids) + len(without) + 1, _log(cluster)
    assert "Unrecoverable error" not in log


def test_a_key_callable_that_raises_a_base_exception_is_a_rejection(hostile_cluster: Cluster, foreign: Celery) -> None:
    """A key callable that raises ``SystemExit``, ``KeyboardInterrupt`` or another ``BaseException`` (no signal to the
    worker) is the message's fault: a recorded rejection with a ``KeyedRejected`` result. Before, it went up through
    the consumer loop (which catches ``Exception`` only), the worker died, and the message, restored unacked, killed
    every worker that took it next."""
    cluster = hostile_cluster
    start_worker(cluster)
    ids = {how: send(foreign, "hostile.escape", args=[how]) for how in ("exit", "interrupt", "base")}
    state = settle(cluster, foreign, list(ids.values()))
    for how, task_id in ids.items():
        got = state[task_id]
        assert got["books"] == "rejected" and got["error"] == "KeyedRejected" and not got["ran"], (how, got)
    fine = send(foreign, "hostile.escape", args=["ok"])
    assert settle(cluster, foreign, [fine])[fine]["books"] == "completed"
    assert_still_serving(cluster, foreign)


def test_an_unusable_eta_or_expires_is_a_recorded_rejection(hostile_cluster: Cluster, foreign: Celery) -> None:
    """An ``eta`` or ``expires`` Celery cannot parse was rejected by Celery's request constructor before the gate saw
    the message ("Received invalid task message"): no outcome in the books, no result, a caller waiting for ever. An
    ETA past year 9999 in UTC had Celery's strategy store its ``OverflowError``, unbooked. Each is now refused as an
    invalid task message first, and a keyed task's is booked as rejected with a ``KeyedRejected`` result."""
    cluster = hostile_cluster
    start_worker(cluster)
    bad = {
        "e-text": {"eta": "not-a-date"},
        "e-month": {"eta": "2026-13-01T00:00:00"},
        "e-number": {"eta": 5},
        "e-list": {"eta": ["2026-01-01"]},
        "e-overflow": {"eta": "9999-12-31T23:59:59-12:00"},
        "x-text": {"expires": "tomorrow"},
        "x-number": {"expires": 1.5},
        "x-dict": {"expires": {"at": 1}},
    }
    for task_id, fields in bad.items():
        _publish_raw(cluster.broker_url, _task_headers(task_id, **fields), [[task_id], {}, {}])
    # a usable one still runs: the check is Celery's own reading of them
    _publish_raw(cluster.broker_url, _task_headers("ok-times", eta="2020-01-01T00:00:00+00:00",
                                                   expires="2999-01-01T00:00:00"), [["ok"], {}, {}])  # fmt: skip
    state = settle(cluster, foreign, [*bad, "ok-times"])
    for task_id in bad:
        got = state[task_id]
        assert got["books"] == "rejected" and got["error"] == "KeyedRejected" and not got["ran"], (task_id, got)
    assert state["ok-times"]["books"] == "completed" and state["ok-times"]["ran"], state["ok-times"]
    assert cluster.scalar("SELECT count(*) FROM observed WHERE key LIKE 'lim:e-%' OR key LIKE 'lim:x-%'") == 0
    assert_still_serving(cluster, foreign)


# -- Trust: which messages may name their own keys ------------------------------------------------------------


def _booked(cluster: Cluster, ids: list[str]) -> dict[str, tuple[Any, Any]]:
    rows = cluster.rows("SELECT task_id, key, group_key FROM keyed_tasks WHERE task_id = ANY(:ids)", ids=ids)
    return {r.task_id: (r.key, r.group_key) for r in rows}


def test_a_foreign_header_cannot_escape_the_declared_key(hostile_cluster: Cluster, foreign: Celery) -> None:
    """A task without ``per_call_keys`` runs under the key it declares for the call's arguments, whatever the headers
    say. Found: a ``keyed_key`` header naming another key won over the declared one, and a message with only a
    ``keyed_group`` header ran with no concurrency key at all — four at once of a key whose limit is 2."""
    cluster = hostile_cluster
    start_worker(cluster, concurrency=4)
    forged = [send(foreign, "hostile.limited", args=["f", 1.0], headers={"keyed_key": f"lim:f{i}"}) for i in range(4)]
    group_only = [
        send(foreign, "hostile.limited", args=["g", 1.0], headers={"keyed_group": f"grp:{i}"}) for i in range(4)
    ]
    state = settle(cluster, foreign, forged + group_only, timeout=120)
    assert all(s["books"] == "completed" and s["result"] == "SUCCESS" for s in state.values()), state
    booked = _booked(cluster, forged + group_only)
    assert {booked[t] for t in forged} == {("lim:f", None)}, booked  # the declared key, not the header's
    assert {booked[t] for t in group_only} == {("lim:g", None)}, booked  # a group header never drops the key
    assert peak_overlap(cluster.intervals("lim:f")) <= LIMITS["lim"]
    assert peak_overlap(cluster.intervals("lim:g")) <= LIMITS["lim"]
    assert "the declared concurrency_key applies" in _log(cluster)
    assert_still_serving(cluster, foreign)


@pytest.fixture
def keyed_producer(hostile_cluster: Cluster) -> Iterator[Any]:
    """A trusted producer: the hostile app itself, with its task module and celery-keyed, in this process."""
    from celery_keyed.publisher import close_publisher
    from tests.acceptance.hostile_proj import make_app

    ns = make_app(hostile_cluster.env)
    yield ns.app
    close_publisher(ns.app)
    ns.app.close()


def test_a_trusted_per_call_key_is_honoured(hostile_cluster: Cluster, keyed_producer: Celery) -> None:
    """A task with ``per_call_keys=True`` runs under the key its producer names per call: four calls whose declared
    keys differ (``lim:a`` … ``lim:d``) all named ``lim:shared`` run at most two at once, the limit of that key."""
    cluster = hostile_cluster
    start_worker(cluster, concurrency=4)
    task = keyed_producer.tasks["hostile.trusted"]
    ids = [task.apply_async((which, 1.0), concurrency_key="lim:shared").id for which in "abcd"]
    state = settle(cluster, keyed_producer, ids, timeout=120)
    assert all(s["books"] == "completed" and s["result"] == "SUCCESS" for s in state.values()), state
    assert set(_booked(cluster, ids).values()) == {("lim:shared", None)}
    assert peak_overlap(cluster.intervals("trusted")) <= LIMITS["lim"]
    # without per_call_keys the producer refuses a per-call key rather than publish one the worker would not follow
    with pytest.raises(InvalidKey, match="per_call_keys=True"):
        keyed_producer.tasks["hostile.limited"].apply_async(("z", 0.1), concurrency_key="lim:other")
