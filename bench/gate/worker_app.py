"""The app bench.gate's workers run (``celery -A bench.gate.worker_app worker``) and its variants.

The producer (``python -m bench.gate``) builds the same app with ``make_app`` to publish; a worker process builds it
from its environment (``ENV_VARIANT``, ``ENV_OBSERVER``, ``CELERY_BROKER_URL``, ``KEYED_DATABASE_URL``), after
preparing its variant (``Variant.prepare``). Every task body RPUSHes its own start and end to a Redis list of the
observer's: the benchmark watches the tasks without Celery or the ledger.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ENV_VARIANT = "BENCH_GATE_VARIANT"  # a name of VARIANTS, for the worker processes
ENV_OBSERVER = "BENCH_GATE_OBSERVER"  # Redis URL of the observer lists
READY_LIST = "bench:gate:ready"  # worker hostnames, pushed by worker_ready
KEYS = 1000  # distinct keys of scenario b
#: A configured name no benchmark task uses: the gate is configured, as it would be in production.
LIMITS = {"bench_gate": {"limit": 10, "shards": 2}}

_observers: dict[int, Any] = {}


def _observer(url: str) -> Any:
    """One Redis client per process (pool processes are forked: never share the parent's socket)."""
    client = _observers.get(os.getpid())
    if client is None:
        import redis

        client = _observers[os.getpid()] = redis.Redis.from_url(url)
    return client


def make_app(variant: str, broker_url: str, database_url: str, observer_url: str) -> Any:
    """The benchmark's Celery app: plain (A), or the same tasks with the gate installed and configured (B).

    Tasks are named explicitly so that the producer (``python -m bench.gate``) and the workers
    (``-A bench.gate.worker_app``) agree."""
    from celery import Celery

    app = Celery("bench_gate", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=None,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    kind = VARIANTS[variant]
    keyed = kind.keyed
    if keyed:
        import celery_keyed

        app.conf.update(keyed_database_url=database_url, keyed_concurrency_limits=LIMITS)
        if kind.loop_admission:  # admission on the consumer loop, one at a time
            app.conf.update(keyed_admission_batch=0)
        celery_keyed.install(app)

    def task(**options: Any) -> Callable[[Callable[..., Any]], Any]:
        """A keyed task in B, the same function as a plain task in A."""
        if keyed and "concurrency_key" in options:
            from celery_keyed import keyed_task

            return keyed_task(app=app, bind=True, **options)
        options.pop("concurrency_key", None)
        return app.task(bind=True, **options)

    @task(name="bench.noop")
    def noop(self: Any, run: str) -> None:
        started = time.time()
        _observer(observer_url).rpush(run, f"{started} {time.time()}")

    @task(name="bench.keyed_noop", concurrency_key="k:{i}")
    def keyed_noop(self: Any, run: str, i: int) -> None:
        started = time.time()
        _observer(observer_url).rpush(run, f"{started} {time.time()}")

    @task(name="bench.hold", concurrency_key="{key}")
    def hold(self: Any, run: str, key: str, seconds: float) -> None:
        started = time.time()
        time.sleep(seconds)
        nonce = "nonce" if getattr(self.request, "keyed_nonce", None) else "-"
        ended = time.time()
        _observer(observer_url).rpush(
            run, f"{started} {ended} {key} {self.request.hostname} {os.getpid()} {nonce} {self.request.id}"
        )

    app.bench_tasks = {"noop": noop, "keyed_noop": keyed_noop, "hold": hold}
    return app


def answer_without_ledger(*, on_loop: bool = False) -> None:
    """A worker of variant "keyed-free" (``--without-ledger``): its claims and releases are answered here, admitted
    and released, without a database call (the heartbeat and the sweeper still run theirs, a few per second). No bound
    is kept: it measures what the worker's own code costs a keyed task, the floor a faster ledger could reach.
    ``on_loop`` (variant "keyed-free-loop"): the releaser's thread is not started either, so a release is answered in
    the outcome hook that hands it over (as a stopped releaser does), and the app admits on the loop
    (``keyed_admission_batch = 0``): the same answers with no thread between the loop and them."""
    from celery_keyed.ledger import Admission, Ledger, ReleaseReport, Verdict

    def admitted(*args: Any, **kwargs: Any) -> Admission:
        return Admission(Verdict.ADMITTED, fence=1, shard=0)

    ledger: Any = Ledger
    ledger.admit = admitted
    ledger.admit_many = lambda self, arrivals, now=None: [admitted() for _ in arrivals]
    ledger.park_at_receipt = lambda self, arrival, now=None: None  # left to its admission
    ledger.release = lambda self, *args, **kwargs: ReleaseReport(released=True)
    ledger.release_many = lambda self, requests, now=None: [ReleaseReport(released=True) for _ in requests]
    ledger.confirm = lambda self, *args, **kwargs: True
    if on_loop:
        from celery_keyed.worker.releaser import Releaser

        releaser: Any = Releaser
        releaser.start = lambda self: None


def _loop_releases() -> None:
    from bench.gate.loop_releases import install

    install()


def _loop_ledger() -> None:
    from bench.gate.loop_releases import install, install_claims

    install()
    install_claims()


@dataclass(frozen=True)
class Variant:
    """A way of running the benchmark's tasks: plain Celery (A) or with celery-keyed installed (B and its probes)."""

    title: str  # as the pair lines print it
    keyed: bool = True  # celery_keyed.install(app), the keyed tasks keyed_tasks
    loop_admission: bool = False  # keyed_admission_batch = 0: admission on the consumer loop
    prepare: Callable[[], None] | None = None  # run in the worker process before the app is built
    loop_calls: bool = False  # its log says what the loop's ledger calls did ("loop-releases:" lines)


VARIANTS: dict[str, Variant] = {
    "plain": Variant("A plain", keyed=False),
    "keyed": Variant("B keyed"),
    "keyed-loop": Variant("B' keyed, loop admission", loop_admission=True),
    "keyed-free": Variant("B0 keyed, no ledger calls", prepare=answer_without_ledger),
    "keyed-free-loop": Variant("B00 keyed, no ledger calls, on the loop", loop_admission=True,
                               prepare=lambda: answer_without_ledger(on_loop=True)),
    "keyed-loop-releases": Variant("B keyed, releases from the loop", prepare=_loop_releases, loop_calls=True),
    "keyed-loop-ledger": Variant("B keyed, claims ahead and releases from the loop", prepare=_loop_ledger,
                                 loop_calls=True),
}


if os.environ.get(ENV_VARIANT):  # a worker: celery -A bench.gate.worker_app worker
    from celery import signals

    _prepare = VARIANTS[os.environ[ENV_VARIANT]].prepare
    if _prepare is not None:
        _prepare()

    app = make_app(
        os.environ[ENV_VARIANT],
        os.environ["CELERY_BROKER_URL"],
        os.environ.get("KEYED_DATABASE_URL", ""),
        os.environ[ENV_OBSERVER],
    )

    @signals.worker_process_init.connect(weak=False)
    def _connect_observer(**kwargs: Any) -> None:
        """Each pool process opens its observer connection when it starts: a task body's first record would
        otherwise connect after the body's end was stamped, and that connect would count in the handoff that
        follows it (the first handoff of every fresh pool process)."""
        _observer(os.environ[ENV_OBSERVER]).ping()

    @signals.worker_ready.connect(weak=False)
    def _announce_ready(sender: Any = None, **kwargs: Any) -> None:
        _observer(os.environ[ENV_OBSERVER]).rpush(READY_LIST, str(getattr(sender, "hostname", "?")))


