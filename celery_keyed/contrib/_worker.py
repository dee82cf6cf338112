"""``python -m celery_keyed.contrib._worker APP [WORKER ARGS...]``: a Celery worker of ``APP`` (a module or
``module:attribute``, as ``celery -A`` takes) with the settings of ``CELERY_KEYED_TEST_CONFIG`` (a JSON object)
applied first. The subprocess worker of the pytest plugin (``keyed_worker_process``) runs this, so that a test
can point a user's own app at the throwaway ledger and broker without the app reading any environment."""

from __future__ import annotations

import json
import os
import sys

CONFIG_ENV = "CELERY_KEYED_TEST_CONFIG"


def main(argv: list[str]) -> int:
    from celery.app.utils import find_app

    if not argv:
        print("usage: python -m celery_keyed.contrib._worker APP [WORKER ARGS...]", file=sys.stderr)
        return 2
    app = find_app(argv[0])
    app.conf.update(json.loads(os.environ.get(CONFIG_ENV) or "{}"))
    if not getattr(app, "_keyed_installed", False):
        print(
            f"celery-keyed: {argv[0]} has no gate: call celery_keyed.install(app) where it is defined", file=sys.stderr
        )
        return 3
    app.worker_main(["worker", *argv[1:]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
