from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0019_admit_plain_many")]
    operations = [apply_core_migrations()]  # ledger migration 0020_keyed_limits
