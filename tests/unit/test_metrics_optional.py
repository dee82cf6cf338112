"""celery_keyed.metrics without its optional extra, and the metrics settings (no servers needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from celery import Celery

from celery_keyed.ledger.errors import InvalidConfig
from celery_keyed.settings import read_settings

WITHOUT_PROMETHEUS = """
import sys
sys.modules["prometheus_client"] = None  # as if the extra were not installed: importing it raises ImportError
from types import SimpleNamespace
from celery_keyed import metrics, gate, beat
from celery_keyed.ledger import Token
assert not metrics.enabled()
metrics.admission("admitted")
metrics.promoted([SimpleNamespace(token=Token("t", 0))], metrics.clock())
metrics.started(Token("t", 0), None)
metrics.drift_repaired(["drift"])
assert metrics.serve(SimpleNamespace(metrics_port=9999, metrics_addr="127.0.0.1")) is None
try:
    metrics.LedgerCollector("postgresql://x@127.0.0.1:1/x")
except RuntimeError as exc:
    assert "pip install 'celery-keyed[prometheus]'" in str(exc)
else:
    raise AssertionError("a collector without prometheus_client")
print("ok")
"""


def test_without_prometheus_client_the_module_imports_and_does_nothing() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_PROMETHEUS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "keyed_metrics_port is set but prometheus_client is not installed" in done.stderr


def _settings(**conf: object):
    app = Celery("settings-test", set_as_current=False)
    app.conf.keyed_database_url = "postgresql+psycopg://x@127.0.0.1/x"
    for name, value in conf.items():
        app.conf[f"keyed_{name}"] = value
    return read_settings(app.conf)


def test_metrics_settings() -> None:
    default = _settings()
    assert (default.metrics_port, default.metrics_addr, default.metrics_timeout) == (None, "0.0.0.0", 2.0)
    assert _settings(metrics_port=9464, metrics_addr="127.0.0.1").metrics_port == 9464
    assert _settings(metrics_port="9464").metrics_port == 9464  # from an environment variable
    assert _settings(metrics_port=0).metrics_port is None


@pytest.mark.parametrize("port", [-1, 70000, "http", 9464.5, True])
def test_a_bad_metrics_port_is_a_clear_error(port: object) -> None:
    with pytest.raises(InvalidConfig, match="keyed_metrics_port must be a TCP port"):
        _settings(metrics_port=port)


def test_a_bad_metrics_timeout_is_a_clear_error() -> None:
    with pytest.raises(InvalidConfig, match="keyed_metrics_timeout must be a positive number"):
        _settings(metrics_timeout=0)


def test_the_status_views_and_the_collector_import_neither_celery_nor_django() -> None:
    """A Django view or a sidecar can expose the ledger gauges without loading Celery (DESIGN §4 layers)."""
    code = (
        "import sys, celery_keyed.ledger.status, celery_keyed.metrics; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    )
    assert "sqlalchemy" in loaded and "prometheus_client" in loaded  # the check itself works
    assert not loaded & {"celery", "kombu", "django"}
