from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0022_durable_batches")]
    operations = [apply_core_migrations()]  # ledger migration 0023_rows_not_configuration
