# The ledger's migration 0006_claims_together (the fast batch claim writes its claims in one statement), applied by the
# core.

from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False  # the core's migrations run on a connection of their own, each in its own transaction

    dependencies = [
        ("celery_keyed_django", "0005_claim_once"),
    ]

    operations = [
        apply_core_migrations(),  # ledger migration 0006_claims_together
    ]
