"""Run by the fresh virtualenv's Python (tests/distribution/test_wheel.py), never by the suite's own: a Django
project on the ledger database, migrated by Django, whose admin pages and action confirmations must all render
from the installed wheel (a missing template is a 500 here, not on an editable install).

Usage: python smoke_admin.py HOST PORT USER DBNAME; prints one line per page checked, exits non-zero on failure.
"""

from __future__ import annotations

import sys
from pathlib import Path

import django
from django.conf import settings

host, port, user, name = sys.argv[1:5]
settings.configure(
    SECRET_KEY="wheel-smoke",
    DEBUG=False,
    USE_TZ=True,
    ALLOWED_HOSTS=["*"],
    ROOT_URLCONF=__name__,
    DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    INSTALLED_APPS=[
        "django.contrib.admin",
        "django.contrib.auth",
        "django.contrib.contenttypes",
        "django.contrib.sessions",
        "django.contrib.messages",
        "django.contrib.staticfiles",
        "celery_keyed_django",
    ],
    MIDDLEWARE=[
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.common.CommonMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ],
    TEMPLATES=[
        {
            "BACKEND": "django.template.backends.django.DjangoTemplates",
            "APP_DIRS": True,
            "OPTIONS": {
                "context_processors": [
                    "django.template.context_processors.request",
                    "django.contrib.auth.context_processors.auth",
                    "django.contrib.messages.context_processors.messages",
                ]
            },
        }
    ],
    DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": name, "USER": user, "HOST": host,
                           "PORT": port}},
    STATIC_URL="/static/",
    CELERY_KEYED_CONCURRENCY_LIMITS={"acct": 1},
)
django.setup()

import celery_keyed_django  # noqa: E402
from celery_keyed_django.ledger import ledger_engine  # noqa: E402
from django.contrib import admin  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.template.loader import get_template  # noqa: E402
from django.test import Client  # noqa: E402
from django.urls import path, reverse  # noqa: E402

from celery_keyed.ledger import Arrival, Ledger, NameConfig  # noqa: E402

urlpatterns = [path("admin/", admin.site.urls)]
APP = "celery_keyed_django"

call_command("migrate", verbosity=0)
call_command("check", fail_level="ERROR")

# Every template the package ships loads (the wheel carries each one).
templates = Path(celery_keyed_django.__file__).parent / "templates"
assert templates.is_dir(), templates
for template in sorted(templates.rglob("*.html")):
    get_template(str(template.relative_to(templates)))
    print("template", template.relative_to(templates))

ledger = Ledger(ledger_engine(), holder="smoke:1:1", lease=60.0)
ledger.configure({"acct": NameConfig("acct", 1)})


def arrival(task_id: str) -> Arrival:
    return Arrival(task_id, key="acct:1", task_name="proj.sync", queue="celery", message={"task": "proj.sync"})


ledger.set_override("acct", 1, reason="smoke", author="smoke")
running = ledger.admit(arrival("smoke-run"))
ledger.admit(arrival("smoke-wait"))

from django.contrib.auth.models import User  # noqa: E402

client = Client()
client.force_login(User.objects.create_superuser("smoke", password="smoke"))


def check(response: object, what: str, *texts: str) -> None:
    status = response.status_code  # type: ignore[attr-defined]
    body = response.content.decode()  # type: ignore[attr-defined]
    assert status == 200, f"{what}: HTTP {status}\n{body[:2000]}"
    for text in texts:
        assert text in body, f"{what}: {text!r} not in the page\n{body[:4000]}"
    print("page", what, status)


check(client.get(reverse("admin:index")), "index", "Keyed concurrency")
for model in admin.site._registry:
    if model._meta.app_label == APP:
        check(client.get(reverse(f"admin:{APP}_{model._meta.model_name}_changelist")), model._meta.model_name)
check(client.get(reverse(f"admin:{APP}_explain"), {"task_id": "smoke-wait"}), "explain", "smoke-wait")
with ledger_engine().connect() as conn:
    arrival_no = conn.exec_driver_sql("SELECT arrival FROM keyed_waiting WHERE task_id = 'smoke-wait'").scalar()
# The three confirmation pages of the admin's actions (templates in subfolders: claim/, waiting/, override/).
check(client.post(reverse(f"admin:{APP}_claim_changelist"),
                  {"action": "force_release_action", "_selected_action": [running.fence]}),
      "claim force release", "smoke-run")
check(client.post(reverse(f"admin:{APP}_waiting_changelist"),
                  {"action": "cancel_action", "_selected_action": [arrival_no]}),
      "waiting cancel", "smoke-wait")
check(client.get(reverse(f"admin:{APP}_override_clear", args=["acct"])), "override clear", "acct")
print("admin smoke ok")
