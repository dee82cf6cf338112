"""The example project imports its Celery app in its package, as Celery's Django recipe does: importing only the
tasks module gives tasks bound to the project's app (its broker, its keyed settings), not to Celery's default app."""

from __future__ import annotations

import subprocess
import sys


def test_importing_only_the_tasks_binds_them_to_the_projects_app() -> None:
    script = (
        "import os, django;"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'example_project.settings');"
        "django.setup();"
        "import example_project.shop.tasks as t, celery;"
        "task = next(v for v in vars(t).values() if isinstance(v, celery.Task));"
        "print(task.app.main, celery.current_app.main)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["example_project", "example_project"], out.stdout + out.stderr
