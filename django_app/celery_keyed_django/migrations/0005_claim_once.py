# The ledger's migration 0005_claim_once (the fast claim reads a key's share once), applied by the core.

from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False  # the core's migrations run on a connection of their own, each in its own transaction

    dependencies = [
        ("celery_keyed_django", "0004_caps"),
    ]

    operations = [
        apply_core_migrations(),  # ledger migration 0005_claim_once
    ]
