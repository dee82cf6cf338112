"""The acceptance app (tests/acceptance/proj.py) with the worker's metrics server on KEYED_METRICS_PORT."""

from __future__ import annotations

import os

from tests.acceptance.proj import app

app.conf.keyed_metrics_port = int(os.environ["KEYED_METRICS_PORT"])
app.conf.keyed_metrics_addr = "127.0.0.1"

__all__ = ["app"]
