# The ledger's migration 0007_rate_clock (a rate's token bucket keeps its clock from going back), applied by the core.

from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False  # the core's migrations run on a connection of their own, each in its own transaction

    dependencies = [
        ("celery_keyed_django", "0006_claims_together"),
    ]

    operations = [
        apply_core_migrations(),  # ledger migration 0007_rate_clock
    ]
