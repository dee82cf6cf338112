from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0029_held_groups")]
    operations = [
        apply_core_migrations(),  # ledger migration 0030_guard_reads_the_server_once (a function only)
    ]
