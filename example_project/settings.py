"""Django settings of the example project, from the environment with embedded defaults.

- ``DATABASE_URL``: Django's database, PostgreSQL (default ``postgresql://postgres@127.0.0.1:5432/example``);
- ``CELERY_KEYED_DATABASE_URL``: the slot ledger (default: the same database, ``postgresql+psycopg://…``);
- ``CELERY_BROKER_URL``: the broker (default ``redis://127.0.0.1:6379/0``), also the result backend unless
  ``CELERY_RESULT_BACKEND`` is set;
- ``CELERY_KEYED_CONCURRENCY_LIMITS``: JSON that replaces the limits below;
- ``EXAMPLE_QUEUE``: the queue of the tasks (default ``shop``; keyed tasks only, so named in ``CELERY_KEYED_QUEUES``);
- ``EXAMPLE_UNIT``: seconds in one time unit (default 0.5): the research deadline is 6 units, the order-event
  retry backoff 1 unit;
- ``DJANGO_SECRET_KEY``, ``DJANGO_DEBUG`` (default off), ``DJANGO_ALLOWED_HOSTS`` (default ``127.0.0.1,localhost``).

Celery reads every ``CELERY_*`` setting here (``app.config_from_object("django.conf:settings", namespace="CELERY")``
in ``example_project/celery.py``): ``CELERY_KEYED_CONCURRENCY_LIMITS`` is Celery's ``keyed_concurrency_limits``.
"""

from __future__ import annotations

import json
import os

from sqlalchemy.engine import make_url

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/example"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"


def env_flag(name: str, default: bool = False) -> bool:
    return os.environ.get(name, "1" if default else "0").strip().lower() in ("1", "true", "yes", "on")


def django_database(url: str) -> dict[str, object]:
    """``DATABASES["default"]`` from a ``postgresql://`` (or ``postgresql+psycopg://``) URL."""
    parsed = make_url(url)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database or "",
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
        "OPTIONS": dict(parsed.query),
    }


def ledger_url(url: str) -> str:
    """The ledger's SQLAlchemy URL for a database URL (the psycopg 3 driver)."""
    return make_url(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


UNIT = float(os.environ.get("EXAMPLE_UNIT") or 0.5)

# -- Django ----------------------------------------------------------------------------------------------------

BASE_DIR = os.path.dirname(os.path.abspath(__file__))
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or "example-project-development-only-never-in-production"
DEBUG = env_flag("DJANGO_DEBUG")
ALLOWED_HOSTS = (os.environ.get("DJANGO_ALLOWED_HOSTS") or "127.0.0.1,localhost").split(",")
ROOT_URLCONF = "example_project.urls"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
STATIC_URL = "/static/"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "celery_keyed_django",  # the ledger's admin; its migrations apply the ledger's schema
    "example_project.shop",  # the tasks (shop/tasks.py) and the demo's observer table
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

DATABASE_URL = os.environ.get("DATABASE_URL") or DEFAULT_DATABASE_URL
DATABASES = {"default": django_database(DATABASE_URL)}

# -- Celery (namespace CELERY) and celery-keyed (CELERY_KEYED_*) ------------------------------------------------

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or DEFAULT_BROKER_URL
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND") or CELERY_BROKER_URL
CELERY_RESULT_EXPIRES = 3600
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("EXAMPLE_QUEUE") or "shop"
# Keyed tasks are admitted when a pool process is ready for them: one message per process, acknowledged after
# the task, redelivered if its worker dies.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# The ledger lives in Django's database: the admin (celery_keyed_django) reads the same tables.
CELERY_KEYED_DATABASE_URL = os.environ.get("CELERY_KEYED_DATABASE_URL") or ledger_url(DATABASE_URL)
# By name (the part of a key before ":"). ``account`` is deliberately absent: an unconfigured name is a mutex per
# key (one sync per account at a time); ``order`` keys are group keys (strict order per order), not gates.
CELERY_KEYED_CONCURRENCY_LIMITS = (
    json.loads(os.environ["CELERY_KEYED_CONCURRENCY_LIMITS"])
    if os.environ.get("CELERY_KEYED_CONCURRENCY_LIMITS")
    else {
        "api": {"limit": 10},  # the partner API: 10 calls in flight, all tenants together
        "tenant": {"limit": 3},  # and at most 3 of them for any one tenant
        "research": {"limit": 2, "max_waiting": 3, "max_wait": 6 * UNIT},  # a bounded waiting room
    }
)
CELERY_KEYED_QUEUES = [CELERY_TASK_DEFAULT_QUEUE]  # keyed tasks only: paused in the broker if Postgres is down
CELERY_KEYED_LEASE = 10.0
CELERY_KEYED_SWEEP_INTERVAL = 0.2  # time-triggered starts (retry backoff, deadlines) within 0.2 s
CELERY_KEYED_RECONCILE_SCHEDULE = 5.0  # beat runs celery_keyed.reconcile every 5 s
CELERY_KEYED_STATEMENT_TIMEOUT = 2.0
CELERY_KEYED_CONNECT_TIMEOUT = 1.0
CELERY_KEYED_CELERY_APP = "example_project.celery:app"  # the admin republishes promotions through it

EXAMPLE_RETRY_BACKOFF = UNIT  # seconds before a failed order event is tried again
