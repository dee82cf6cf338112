from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0021_cached_plans")]
    operations = [apply_core_migrations()]  # ledger migration 0022_rows_not_configuration
