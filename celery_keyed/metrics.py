"""Prometheus metrics (optional extra: ``pip install 'celery-keyed[prometheus]'``).

Two kinds, documented in docs/metrics.md:

- **Ledger gauges**, read from Postgres when scraped by ``LedgerCollector``: in flight, waiting, oldest waiting
  age, effective limit and keys, per name (never per key: 100,000 keys would be 100,000 series). One aggregated
  query (``celery_keyed.ledger.status``), bounded by a statement timeout; a scrape that cannot reach the ledger
  reports ``celery_keyed_ledger_up 0`` instead of failing. They are cluster-wide: every process that exposes
  them reports the same values.
- **Process counters**, moved by the code that sees the event: admission outcomes and the handoff latency in
  the worker's gate (its main process), drift repaired by the reconcile task wherever it runs (a pool process
  under prefork: set ``PROMETHEUS_MULTIPROC_DIR`` to collect them from every process, see ``serve``).

Without ``prometheus_client`` this module still imports, every hook is a no-op, and ``serve`` logs that the
extra is missing.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import sqlalchemy as sa

from celery_keyed.ledger import fair_shares, held_groups_by_name, status_names, status_prepare

logger = logging.getLogger("celery_keyed")

try:
    import prometheus_client
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError:  # the optional extra is not installed: every hook below is a no-op
    prometheus_client = None  # type: ignore[assignment]
    Collector = object  # type: ignore[assignment,misc]

#: The most (key, fair key) rows a scrape reads for the fair gauges (fair keys that hold or wait).
FAIR_SERIES_MAX = 1000

#: Seconds: a handoff is well under 25 ms (DESIGN §8); the upper buckets catch republished promotions.
HANDOFF_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: A promotion whose start this process has not seen within this many seconds is forgotten (it was republished
#: and started by another worker, or it was lost and re-parked).
_HANDOFF_FORGET_AFTER = 60.0
_HANDOFF_MAX_PENDING = 10_000

if prometheus_client is not None:
    ADMISSIONS: Any = prometheus_client.Counter(
        "celery_keyed_admissions",
        "Keyed arrivals by what the gate did with them when a pool process was ready: admitted (slot taken), "
        "promoted (a handed-off slot started), parked, rejected (waiting room full or malformed keys), expired, "
        "duplicate, held (the ledger was unreachable).",
        ["outcome"],
    )
    HANDOFF: Any = prometheus_client.Histogram(
        "celery_keyed_handoff_seconds",
        "Seconds from a release that promoted a parked attempt to that attempt's start in this worker.",
        buckets=HANDOFF_BUCKETS,
    )
    DRIFT: Any = prometheus_client.Counter(
        "celery_keyed_reconcile_drift_repaired",
        "Counters found out of step with the claims and parked rows that exist, and repaired, by reconcile "
        "(each one is a bug: please report it).",
    )
    OUTBOX_PUBLISHED: Any = prometheus_client.Counter(
        "celery_keyed_outbox_published",
        "Messages of the outbox (keyed_register_at_publish) published by this process's relay: kind 'republished' "
        "(no worker received an earlier copy in time: the broker lost it, or it is late), 'first' (registered in a "
        "caller's transaction, published after its commit), 'failed' (the publish raised; retried when due again).",
        ["kind"],
    )
    DEBOUNCED: Any = prometheus_client.Counter(
        "celery_keyed_debounced",
        "Debounced arrivals by what admission did: 'parked' (waits out its key's quiet period), "
        "'replaced' (an earlier arrival of its burst was recorded superseded in its favour, keep last), 'superseded' "
        "(recorded superseded at arrival: the burst's first arrival runs, keep first).",
        ["kind"],
    )
    NEWEST_WINS: Any = prometheus_client.Counter(
        "celery_keyed_newest_wins",
        "Newest wins (on_newer='cancel_running'): 'requested' (an arrival admitted or parked by this "
        "worker asked for the cancellation of an older attempt of its key and supersede key), 'cancelled' (this "
        "worker passed a request on to an attempt it runs: terminated its pool process, or raised its "
        "keyed_cancelled() flag), 'superseded' (such an attempt ended and was released as superseded).",
        ["kind"],
    )
    SENDS: Any = prometheus_client.Counter(
        "celery_keyed_sends",
        "Calls this process asked the ledger about before publishing (refusal at send): verdict "
        "'accepted' (a place reserved, published), 'known' (a retry of a task id that had its place), 'room_full' "
        "or 'duplicate' (refused: KeyedRejected raised, nothing published).",
        ["verdict"],
    )
    FAILOVERS: Any = prometheus_client.Counter(
        "celery_keyed_ledger_failovers",
        "Changes of the ledger's server this process saw (a standby promoted, another server, a restart): each one "
        "holds new keyed starts for one lease. Alert on any increase.",
    )
    REASSERTED: Any = prometheus_client.Counter(
        "celery_keyed_claims_reasserted",
        "Claims of running tasks lost in a ledger failover that this process took back: verdict 'reasserted', "
        "'kept' (it was there after all) or 'refused' (its slot was held: tried again at the next heartbeat until the "
        "task's lease would end, when it is stopped and runs again).",
        ["verdict"],
    )
else:
    ADMISSIONS = HANDOFF = DRIFT = OUTBOX_PUBLISHED = DEBOUNCED = NEWEST_WINS = SENDS = None
    FAILOVERS = REASSERTED = None

_promoted_at: dict[Any, float] = {}  # attempt token -> monotonic time of the release that promoted it
_promoted_lock = threading.Lock()


def enabled() -> bool:
    """Whether ``prometheus_client`` is installed (else every hook is a no-op)."""
    return prometheus_client is not None


def clock() -> float:
    """The clock handoffs are measured with."""
    return time.monotonic()


def admission(outcome: str) -> None:
    """Count one arrival's admission outcome (``Verdict`` value, ``promoted`` or ``held``)."""
    if ADMISSIONS is not None:
        ADMISSIONS.labels(outcome=outcome).inc()


def promoted(promotions: Iterable[Any], released_at: float) -> None:
    """A release that began at ``released_at`` (``clock()``) promoted these attempts: time their start."""
    if HANDOFF is None:
        return
    with _promoted_lock:
        for promotion in promotions:
            _promoted_at[promotion.token] = released_at
        if len(_promoted_at) > _HANDOFF_MAX_PENDING:
            horizon = clock() - _HANDOFF_FORGET_AFTER
            for token in [t for t, at in _promoted_at.items() if at < horizon]:
                del _promoted_at[token]


def started(token: Any, verdict: Any) -> None:
    """The gate decided about ``token``: ``verdict`` is its admission's verdict, or None when it starts on a
    promoted slot (its handoff latency is observed if this process saw the release)."""
    if ADMISSIONS is None:
        return
    if verdict is not None:
        ADMISSIONS.labels(outcome=str(getattr(verdict, "value", verdict))).inc()
        return
    ADMISSIONS.labels(outcome="promoted").inc()
    with _promoted_lock:
        released_at = _promoted_at.pop(token, None)
    if released_at is not None:
        HANDOFF.observe(max(0.0, clock() - released_at))


def debounced(admission: Any) -> None:
    """Count a debounced arrival's admission (``Admission.debounced``): parked, replaced arrivals, superseded."""
    if DEBOUNCED is None or not getattr(admission, "debounced", False):
        return
    verdict = str(getattr(admission.verdict, "value", admission.verdict))
    if verdict == "parked":
        DEBOUNCED.labels(kind="parked").inc()
        if admission.superseded:
            DEBOUNCED.labels(kind="replaced").inc(len(admission.superseded))
    elif verdict == "superseded":
        DEBOUNCED.labels(kind="superseded").inc()


def newest_wins(kind: str, count: int = 1) -> None:
    """Count newest-wins cancellations: ``requested``, ``cancelled`` or ``superseded``."""
    if NEWEST_WINS is not None and count:
        NEWEST_WINS.labels(kind=kind).inc(count)


def send_decided(verdict: str) -> None:
    """Count one refusal-at-send verdict of this process: ``accepted``, ``known``, ``room_full`` or ``duplicate``."""
    if SENDS is not None:
        SENDS.labels(verdict=verdict).inc()


def outbox_published(kind: str, count: int = 1) -> None:
    """Count messages the outbox relay published (``republished``, ``first``) or failed to publish (``failed``)."""
    if OUTBOX_PUBLISHED is not None and count:
        OUTBOX_PUBLISHED.labels(kind=kind).inc(count)


def failover(count: int = 1) -> None:
    """Count changes of the ledger's server this process saw (failovers, restarts)."""
    if FAILOVERS is not None and count:
        FAILOVERS.inc(count)


def reasserted(verdict: str) -> None:
    """Count one re-assertion of a claim lost in a failover, by verdict."""
    if REASSERTED is not None:
        REASSERTED.labels(verdict=verdict).inc()


def drift_repaired(drift: list[str]) -> None:
    """Count the drift a reconcile pass found and repaired."""
    if DRIFT is not None and drift:
        DRIFT.inc(len(drift))


class LedgerCollector(Collector):
    """Ledger gauges per name, queried from Postgres on every scrape.

    Register it in any registry: ``prometheus_client.REGISTRY.register(LedgerCollector(url))`` (a Django view,
    a sidecar, a worker through ``keyed_metrics_port``). ``database`` is a SQLAlchemy URL or an engine; the
    collector keeps one connection at most. ``timeout`` bounds connect + query (seconds).
    """

    def __init__(self, database: str | sa.Engine, *, timeout: float = 2.0) -> None:
        if prometheus_client is None:
            raise RuntimeError("celery-keyed metrics need prometheus_client: pip install 'celery-keyed[prometheus]'")
        self.timeout = float(timeout)
        if isinstance(database, sa.Engine):
            self.engine = database
        else:
            url = str(database)
            if url.startswith(("postgresql://", "postgres://")):
                url = "postgresql+psycopg://" + url.split("://", 1)[1]
            self.engine = sa.create_engine(
                url,
                pool_size=1,
                max_overflow=0,
                pool_timeout=self.timeout,
                pool_pre_ping=True,
                # no server-side prepared statements: a transaction pooler (PgBouncer) would lose them between scrapes
                connect_args={
                    "connect_timeout": max(1, math.ceil(self.timeout)),
                    "application_name": "celery-keyed",
                    "prepare_threshold": None,
                },
            )

    @classmethod
    def for_app(cls, app: Any, *, timeout: float | None = None) -> LedgerCollector:
        """A collector on the ledger of a Celery app (its ``keyed_database_url``)."""
        from celery_keyed.settings import read_settings

        settings = read_settings(app.conf)
        return cls(settings.database_url, timeout=settings.metrics_timeout if timeout is None else timeout)

    def describe(self) -> Iterator[Metric]:
        # The families without samples: registering never queries the ledger.
        yield from self._families()
        yield from self._key_overrides([])
        yield from self._fair([])
        yield self._groups_held({})

    def collect(self) -> Iterator[Metric]:
        started_at = time.perf_counter()
        families = self._families()
        up = 1.0
        try:
            with self.engine.begin() as conn:
                status_prepare(conn, timeout=self.timeout)
                names = status_names(conn)
                shares = fair_shares(conn, limit=FAIR_SERIES_MAX)
                held = held_groups_by_name(conn)
        except Exception as exc:
            logger.warning("celery-keyed metrics: could not read the ledger: %s", exc)
            names, shares, held = [], [], {}
            up = 0.0
        in_flight, waiting, oldest, limit, keys, paused, up_family, duration = families
        for n in names:
            in_flight.add_metric([n.name], n.in_flight)
            waiting.add_metric([n.name], n.waiting)
            oldest.add_metric([n.name], n.oldest_waiting_age or 0.0)
            limit.add_metric([n.name, n.source], n.limit)
            keys.add_metric([n.name], n.keys)
            paused.add_metric([n.name], 1.0 if n.paused else 0.0)
        up_family.add_metric([], up)
        duration.add_metric([], time.perf_counter() - started_at)
        yield from families
        yield from self._key_overrides(names)
        yield from self._fair(shares)
        yield self._groups_held(held)

    @staticmethod
    def _key_overrides(names: list[Any]) -> list[GaugeMetricFamily]:
        """A key that throttles itself: per name, how many of its keys are paused on their own now, how many have a
        limit of their own, and how many a limit their call computed (never a series per key)."""
        paused = GaugeMetricFamily(
            "celery_keyed_keys_paused", "Keys of a name paused on their own now (keyed_pause, pause-key).",
            labels=["name"],
        )
        limited = GaugeMetricFamily(
            "celery_keyed_keys_own_limit", "Keys of a name with a limit of their own now (keyed_set_limit).",
            labels=["name"],
        )
        called = GaugeMetricFamily(
            "celery_keyed_keys_call_limit",
            "Keys of a name whose limit their latest call computed (a task's concurrency_limit).",
            labels=["name"],
        )
        windowed = GaugeMetricFamily(
            "celery_keyed_keys_window_full",
            "Keys of a name with a full rate window now (their next start waits until it frees).",
            labels=["name"],
        )
        for n in names:
            paused.add_metric([n.name], n.paused_keys)
            limited.add_metric([n.name], n.limited_keys)
            called.add_metric([n.name], n.call_limited_keys)
            windowed.add_metric([n.name], n.window_full_keys)
        return [paused, limited, called, windowed]

    @staticmethod
    def _fair(shares: list[Any]) -> list[GaugeMetricFamily]:
        """Weighted fair sharing: per fair name and fair key (summed over the name's keys; only
        fair keys that hold or wait, at most FAIR_SERIES_MAX rows read), slots held, attempts waiting, weight."""
        held = GaugeMetricFamily(
            "celery_keyed_fair_in_flight", "Slots a fair key holds over the keys of a fair name.",
            labels=["name", "fair_key"],
        )
        waiting = GaugeMetricFamily(
            "celery_keyed_fair_waiting", "Parked attempts of a fair key over the keys of a fair name.",
            labels=["name", "fair_key"],
        )
        weight = GaugeMetricFamily(
            "celery_keyed_fair_weight", "The weight of a fair key of a fair name (override, task, table, else 1).",
            labels=["name", "fair_key"],
        )
        sums: dict[tuple[str, str], list[float]] = {}
        for share in shares:
            row = sums.setdefault((share.key.split(":", 1)[0], share.fair_key or ""), [0.0, 0.0, 0.0])
            row[0] += share.holding
            row[1] += share.waiting
            row[2] = max(row[2], share.weight)
        for labels, (h, w, wt) in sorted(sums.items()):
            held.add_metric(list(labels), h)
            waiting.add_metric(list(labels), w)
            weight.add_metric(list(labels), wt)
        return [held, waiting, weight]

    @staticmethod
    def _groups_held(held: dict[str, int]) -> GaugeMetricFamily:
        """Groups held for an operator (a group name whose ``group_failure`` is ``hold``, after its head failed), per
        group name: nothing of a held group starts until someone resumes it or skips its head."""
        family = GaugeMetricFamily(
            "celery_keyed_groups_held",
            "Groups of a group name held for an operator after their head failed (group_failure 'hold').",
            labels=["name"],
        )
        for name, count in held.items():
            family.add_metric([name], count)
        return family

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "celery_keyed_in_flight",
                "Slots held (running, promoted, uncertain, reserved) over the keys of a name.",
                labels=["name"],
            ),
            GaugeMetricFamily("celery_keyed_waiting", "Parked attempts over the keys of a name.", labels=["name"]),
            GaugeMetricFamily(
                "celery_keyed_oldest_waiting_seconds",
                "Age of the oldest parked attempt of a name (0 when none waits).",
                labels=["name"],
            ),
            GaugeMetricFamily(
                "celery_keyed_limit",
                "Effective slots per key of a name; source: override, config or default (0 = paused).",
                labels=["name", "source"],
            ),
            GaugeMetricFamily("celery_keyed_keys", "Keys of a name the ledger holds rows for.", labels=["name"]),
            GaugeMetricFamily("celery_keyed_paused", "1 when a name's effective limit is 0.", labels=["name"]),
            GaugeMetricFamily("celery_keyed_ledger_up", "1 when the last scrape could read the ledger."),
            GaugeMetricFamily("celery_keyed_ledger_scrape_seconds", "Seconds the last scrape of the ledger took."),
        ]


_served: dict[str, Any] = {}
_serve_lock = threading.Lock()


def serve(settings: Any) -> Any:
    """Start the metrics HTTP server of this process on ``keyed_metrics_port`` (once; later calls return the
    first registry). The endpoint has the process counters and the ledger gauges; with
    ``PROMETHEUS_MULTIPROC_DIR`` set it aggregates the counters of every process of the worker (pool processes
    run the reconcile task). A port already taken is logged, never fatal. Returns the registry served, or None."""
    port = getattr(settings, "metrics_port", None)
    if not port:
        return None
    if prometheus_client is None:
        logger.error("celery-keyed: keyed_metrics_port is set but prometheus_client is not installed (pip install "
                     "'celery-keyed[prometheus]'); no metrics are served")  # fmt: skip
        return None
    with _serve_lock:
        if "registry" in _served:
            return _served["registry"]
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = prometheus_client.REGISTRY
        collector = LedgerCollector(settings.database_url, timeout=settings.metrics_timeout)
        registered = True
        try:
            registry.register(collector)
        except ValueError:  # the application registered a LedgerCollector itself
            logger.info("celery-keyed metrics: ledger gauges already registered; not adding them twice")
            registered = False
        try:
            started_server = prometheus_client.start_http_server(port, addr=settings.metrics_addr, registry=registry)
        except OSError as exc:
            logger.error("celery-keyed: cannot serve metrics on %s:%s: %s", settings.metrics_addr, port, exc)
            if registered:
                registry.unregister(collector)
            return None
        _served.update(registry=registry, collector=collector, server=started_server)
        logger.info("celery-keyed: metrics on http://%s:%s/metrics", settings.metrics_addr, port)
        return registry
