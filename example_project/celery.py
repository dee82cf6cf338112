"""The example project's Celery app: ``celery -A example_project.celery worker`` (and ``beat``).

Configured from Django's settings (``CELERY_*``, including ``CELERY_KEYED_*``); ``celery_keyed.install(app)`` adds
the gate to every worker and the reconciler to beat; the tasks come from ``shop/tasks.py`` (autodiscovered).
"""

from __future__ import annotations

import os

from celery import Celery

import celery_keyed

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "example_project.settings")

app = Celery("example_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
celery_keyed.install(app)
app.autodiscover_tasks()
