"""Settings of celery-keyed, read from the Celery app's configuration.

Every setting is documented in docs/settings.md. In Django, put them in settings.py with the
``CELERY_`` prefix (``CELERY_KEYED_DATABASE_URL``) when the app is configured with
``app.config_from_object("django.conf:settings", namespace="CELERY")``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from celery_keyed.ledger import (
    INT_MAX,
    SECONDS_MAX,
    STATEMENT_TIMEOUT_MAX,
    InvalidConfig,
    NameConfig,
    check_int,
    check_seconds,
    parse_limits,
)

#: The most ledger connections a worker process may keep (``keyed_pool_size``; as many again may overflow).
POOL_SIZE_MAX = 1000

#: Defaults of every setting (name without the ``keyed_`` prefix → value).
DEFAULTS: dict[str, Any] = {
    "database_url": None,  # SQLAlchemy URL of the ledger; env KEYED_DATABASE_URL when unset
    "database": None,  # Django only: alias in settings.DATABASES of the ledger's database, instead of a URL
    "concurrency_limits": {},  # by name: an int (the limit) or {limit, shards, max_waiting, max_wait, overflow}
    "lease": 60.0,  # seconds a claim lives without renewal (D7)
    "heartbeat_interval": None,  # seconds between renewals; default lease / 6
    "self_fence": True,  # terminate keyed tasks of a prefork worker that cannot renew in time (D7)
    "self_fence_margin": None,  # seconds before lease expiry at which to self-fence; default lease / 6
    "sweep_interval": 1.0,  # seconds between due-time sweeps (D2): the bound for time-triggered starts
    "dispatch_timeout": 30.0,  # seconds a promoted attempt may take to be bound before it is re-parked
    "reconcile_schedule": 30.0,  # seconds between beat runs of celery_keyed.reconcile
    "idle_key_ttl": 3600.0,  # seconds after which an idle key's rows are dropped
    "books_retention": 7 * 86400.0,  # seconds a finished task id stays in the books (keyed_tasks); 0 = for ever
    "group_arrival_timeout": 300.0,  # seconds a registered group number may take to arrive (D10)
    "reserve_timeout": 60.0,  # seconds a multi-key waiter may hold reserved slots (docs/ledger.md)
    "register_groups": True,  # allocate group numbers at publish (in Postgres)
    "local_handoff": True,  # run a promoted attempt here when this worker consumes its queue (D4)
    "probe_interval": 1.0,  # seconds between probes of an unreachable Postgres (D9)
    "metrics_port": None,  # serve Prometheus metrics from each worker on this port (celery_keyed.metrics); off
    "metrics_addr": "0.0.0.0",  # address the metrics server listens on
    "metrics_timeout": 2.0,  # seconds a scrape may spend reading the ledger gauges
    "connect_timeout": 3.0,  # seconds to connect to Postgres
    "statement_timeout": 5.0,  # seconds a ledger statement may take (bounds a blocked consumer loop)
    "pool_size": 5,  # ledger connections per worker process
    "connect_args": {},  # extra keyword arguments of psycopg.connect for ledger connections (sslmode, keepalives…)
    "pooler": None,  # a connection pooler (PgBouncer) between us and PostgreSQL: None detects, True / False say
    "queues": (),  # queues that carry only keyed tasks: not consumed while the ledger is unreachable (D9)
    "admission_batch": 64,  # most arrivals one ledger call admits, off the consumer loop; 0: admit on the loop
    "park_at_receipt": True,  # park an arrival of a key with a line when received, without a pool process
    # claim a received arrival's slot while it waits for a pool process expected within this many seconds (True: 0.05)
    "claim_ahead": True,
    "send_arrival_timeout": 3600.0,  # seconds a send accepted at send holds its place until it arrives
    "config_version": 0,  # version of keyed_concurrency_limits: an older worker never overwrites a newer one's
    "register_at_publish": False,  # store each keyed message in the ledger at publish; republish what never arrives
    "fair_weights": {},  # by fair name: {fair-key prefix: weight}; joins that name's keyed_concurrency_limits entry
}


@dataclass(frozen=True)
class KeyedSettings:
    database_url: str
    limits: dict[str, NameConfig] = field(default_factory=dict)
    lease: float = 60.0
    heartbeat_interval: float = 10.0
    self_fence: bool = True
    self_fence_margin: float = 10.0
    sweep_interval: float = 1.0
    dispatch_timeout: float = 30.0
    reconcile_schedule: float = 30.0
    idle_key_ttl: float = 3600.0
    books_retention: float | None = 7 * 86400.0  # None: keep every finished task id
    group_arrival_timeout: float = 300.0
    reserve_timeout: float = 60.0
    register_groups: bool = True
    local_handoff: bool = True
    probe_interval: float = 1.0
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"
    metrics_timeout: float = 2.0
    connect_timeout: float = 3.0
    statement_timeout: float = 5.0
    pool_size: int = 5
    connect_args: dict[str, Any] = field(default_factory=dict)
    pooler: bool | None = None  # None: detected per engine (celery_keyed.ledger.session)
    queues: tuple[str, ...] = ()
    admission_batch: int = 64
    park_at_receipt: bool = True
    claim_ahead: float = 0.05  # seconds; 0.0: off
    send_arrival_timeout: float = 3600.0
    config_version: int = 0
    register_at_publish: bool = False


def read_settings(conf: Any) -> KeyedSettings:
    """Read and validate the ``keyed_*`` settings of a Celery app's ``conf``; a bad value is a clear error."""

    def get(name: str) -> Any:
        value = conf.get(f"keyed_{name}")
        return DEFAULTS[name] if value is None else value

    url = get("database_url")
    if not url and get("database"):
        url = django_database_url(str(get("database")))
    url = url or os.environ.get("KEYED_DATABASE_URL")
    if not url:
        raise InvalidConfig(
            "celery-keyed needs a ledger: set app.conf.keyed_database_url (in Django: CELERY_KEYED_DATABASE_URL, or"
            " CELERY_KEYED_DATABASE naming an alias of DATABASES), or the KEYED_DATABASE_URL environment variable,"
            " to a postgresql+psycopg:// URL"
        )
    url = str(url)
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    lease = _seconds(get("lease"), "keyed_lease")
    heartbeat = get("heartbeat_interval")
    heartbeat = lease / 6 if heartbeat is None else _seconds(heartbeat, "keyed_heartbeat_interval")
    if heartbeat >= lease / 2:
        raise InvalidConfig(f"keyed_heartbeat_interval ({heartbeat}) must be well below keyed_lease ({lease})")
    margin = get("self_fence_margin")
    margin = lease / 6 if margin is None else _seconds(margin, "keyed_self_fence_margin")
    if margin >= lease:  # the self-fence would stop every attempt at once (D19)
        raise InvalidConfig(f"keyed_self_fence_margin ({margin}) must be below keyed_lease ({lease})")
    statement_timeout = _seconds(get("statement_timeout"), "keyed_statement_timeout", maximum=STATEMENT_TIMEOUT_MAX)
    if statement_timeout < 0.001:  # Postgres counts it in whole milliseconds, and 0 would mean "no timeout"
        raise InvalidConfig(f"keyed_statement_timeout must be at least 0.001 seconds, got {statement_timeout!r}")
    return KeyedSettings(
        database_url=url,
        limits=with_fair_weights(parse_limits(get("concurrency_limits")), get("fair_weights")),
        lease=lease,
        heartbeat_interval=heartbeat,
        self_fence=bool(get("self_fence")),
        self_fence_margin=margin,
        sweep_interval=_seconds(get("sweep_interval"), "keyed_sweep_interval"),
        dispatch_timeout=_seconds(get("dispatch_timeout"), "keyed_dispatch_timeout"),
        reconcile_schedule=_seconds(get("reconcile_schedule"), "keyed_reconcile_schedule"),
        idle_key_ttl=_seconds(get("idle_key_ttl"), "keyed_idle_key_ttl"),
        books_retention=_retention(get("books_retention")),
        group_arrival_timeout=_seconds(get("group_arrival_timeout"), "keyed_group_arrival_timeout"),
        reserve_timeout=_seconds(get("reserve_timeout"), "keyed_reserve_timeout"),
        register_groups=bool(get("register_groups")),
        local_handoff=bool(get("local_handoff")),
        probe_interval=_seconds(get("probe_interval"), "keyed_probe_interval"),
        metrics_port=_port(get("metrics_port")),
        metrics_addr=str(get("metrics_addr")),
        metrics_timeout=_seconds(get("metrics_timeout"), "keyed_metrics_timeout"),
        # libpq reads connect_timeout as an int of seconds
        connect_timeout=_seconds(get("connect_timeout"), "keyed_connect_timeout", maximum=INT_MAX),
        statement_timeout=statement_timeout,
        pool_size=_pool_size(get("pool_size")),
        connect_args=_connect_args(get("connect_args")),
        pooler=None if get("pooler") is None else _flag(get("pooler"), "keyed_pooler"),
        queues=_queue_names(get("queues")),
        admission_batch=check_int(get("admission_batch"), "keyed_admission_batch", minimum=0, maximum=10_000),
        park_at_receipt=bool(get("park_at_receipt")),
        claim_ahead=_claim_ahead(get("claim_ahead")),
        send_arrival_timeout=_seconds(get("send_arrival_timeout"), "keyed_send_arrival_timeout"),
        config_version=check_int(get("config_version"), "keyed_config_version", minimum=0, maximum=INT_MAX),
        register_at_publish=_flag(get("register_at_publish"), "keyed_register_at_publish"),
    )


def with_fair_weights(limits: dict[str, NameConfig], setting: Any) -> dict[str, NameConfig]:
    """``keyed_fair_weights`` ({name: {fair-key prefix: weight}}) merged into the names' configurations: each name
    must be configured ``fair`` in ``keyed_concurrency_limits`` (weights share a fair name's slots; a typo must not
    pass silently). The table replaces a ``fair_weights`` option given there."""
    if not setting:
        return limits
    if not isinstance(setting, Mapping):
        raise InvalidConfig(f"keyed_fair_weights must be a dict by name, got {type(setting).__name__}")
    merged = dict(limits)
    for name, table in setting.items():
        config = limits.get(name)
        if config is None or not config.fair:
            raise InvalidConfig(
                f"keyed_fair_weights names {name!r}, which keyed_concurrency_limits does not configure as fair"
                " (add fair: True)"
            )
        merged[name] = dataclasses.replace(config, fair_weights=table)
    return merged


def django_database_url(alias: str, databases: dict[str, Any] | None = None) -> str:
    """The SQLAlchemy URL of Django's ``DATABASES[alias]`` (``keyed_database``, i.e. ``CELERY_KEYED_DATABASE``), so a
    Django project names its database once. ``databases`` defaults to ``django.conf.settings.DATABASES``."""
    if databases is None:
        try:
            from django.conf import settings as django_settings

            databases = dict(django_settings.DATABASES)
        except Exception as exc:  # Django missing, or its settings not configured in this process
            raise InvalidConfig(
                f"keyed_database = {alias!r} names a Django database, but Django's settings cannot be read here "
                f"({exc}); configure Django first or set keyed_database_url"
            ) from None
    if alias not in databases:
        raise InvalidConfig(f"keyed_database = {alias!r} is not an alias in Django's DATABASES ({sorted(databases)})")
    entry = databases[alias]
    engine = str(entry.get("ENGINE", ""))
    if "postgresql" not in engine and "postgis" not in engine:
        raise InvalidConfig(
            f"keyed_database = {alias!r}: the ledger needs PostgreSQL, but DATABASES[{alias!r}] uses {engine!r}"
        )
    import sqlalchemy as sa

    options = entry.get("OPTIONS") or {}
    query = {k: str(v) for k, v in options.items() if isinstance(v, str | int) and not isinstance(v, bool)}
    port = entry.get("PORT")
    url = sa.engine.URL.create(
        "postgresql+psycopg",
        username=entry.get("USER") or None,
        password=entry.get("PASSWORD") or None,
        host=entry.get("HOST") or None,
        port=int(port) if port not in (None, "") else None,
        database=entry.get("NAME") or None,
        query=query,
    )
    return url.render_as_string(hide_password=False)


def _flag(value: Any, setting: str) -> bool:
    """A boolean setting: True or False (a typo such as "no" must not turn a feature on)."""
    if not isinstance(value, bool):
        raise InvalidConfig(f"{setting} must be True or False, got {value!r}")
    return value


#: ``keyed_claim_ahead = True``: the most seconds a request may be expected to wait for a pool process for its slot to
#: be claimed while it waits.
CLAIM_AHEAD_WAIT = 0.05


def _claim_ahead(value: Any) -> float:
    """``keyed_claim_ahead``: True (``CLAIM_AHEAD_WAIT``), False (0.0: off) or the most seconds (at most 60) a
    request may be expected to wait for a pool process for its slot to be claimed while it waits."""
    if value is True:
        return CLAIM_AHEAD_WAIT
    if value is False or (value == 0 and isinstance(value, int | float)):
        return 0.0
    try:
        return _seconds(value, "keyed_claim_ahead", maximum=60.0)
    except InvalidConfig:
        raise InvalidConfig(
            f"keyed_claim_ahead must be True, False or a number of seconds (at most 60), got {value!r}"
        ) from None


def _port(value: Any) -> int | None:
    """``keyed_metrics_port``: a TCP port, or None / 0 for no metrics server."""
    if value is None or value == 0:
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise InvalidConfig(f"keyed_metrics_port must be a TCP port (1-65535) or None, got {value!r}")
    return value


def _seconds(value: Any, setting: str, *, maximum: float = SECONDS_MAX) -> float:
    """A duration setting: a finite positive number of seconds that timestamps and timers can hold."""
    return check_seconds(value, setting, maximum=maximum)


def _retention(value: Any) -> float | None:
    """``keyed_books_retention``: seconds a finished task id stays in the books; 0 keeps them for ever (None)."""
    if value == 0 and not isinstance(value, bool):
        return None
    return _seconds(value, "keyed_books_retention")


def _pool_size(value: Any) -> int:
    """``keyed_pool_size``: a whole number of connections (a float with no fraction is taken as that number)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_int(value, "keyed_pool_size", minimum=1, maximum=POOL_SIZE_MAX)


def _connect_args(value: Any) -> dict[str, Any]:
    """``keyed_connect_args``: a table of psycopg.connect keyword arguments (name -> value)."""
    if not isinstance(value, dict) or not all(isinstance(name, str) and name for name in value):
        raise InvalidConfig(f"keyed_connect_args must be a table of psycopg.connect arguments, got {value!r}")
    return dict(value)


def _queue_names(value: Any) -> tuple[str, ...]:
    """``keyed_queues``: a list of queue names, or one comma-separated string (like ``celery worker -Q``)."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list | tuple | set | frozenset) or not all(isinstance(v, str) and v for v in value):
        raise InvalidConfig(f"keyed_queues must be a list of queue names, got {value!r}")
    return tuple(value)
