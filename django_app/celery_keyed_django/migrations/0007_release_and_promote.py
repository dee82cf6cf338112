from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0006_send_and_config_versions")]
    operations = [apply_core_migrations()]  # ledger migration 0007_release_and_promote
