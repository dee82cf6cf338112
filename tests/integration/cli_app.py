"""A Celery app for ``celery -A tests.integration.cli_app keyed ...`` in a subprocess (tests/integration/test_cli.py),
configured from the environment: KEYED_DATABASE_URL, CELERY_BROKER_URL, KEYED_LIMITS (JSON)."""

from __future__ import annotations

import json
import os

from celery import Celery

import celery_keyed

app = Celery("cli-test", broker=os.environ.get("CELERY_BROKER_URL", "memory://"), set_as_current=False)
app.conf.keyed_database_url = os.environ.get("KEYED_DATABASE_URL")
app.conf.keyed_concurrency_limits = json.loads(os.environ.get("KEYED_LIMITS", "{}"))
celery_keyed.install(app)
