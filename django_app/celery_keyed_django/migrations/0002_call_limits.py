# The ledger's migration 0002_call_limits (limits computed from the call), applied by the core.

from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False  # the core's migrations run on a connection of their own, each in its own transaction

    dependencies = [
        ("celery_keyed_django", "0001_initial"),
    ]

    operations = [
        apply_core_migrations(),  # ledger migration 0002_call_limits
    ]
