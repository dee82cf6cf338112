from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0012_readers_writers")]
    operations = [apply_core_migrations()]  # ledger migration 0013_generic_release_plans
