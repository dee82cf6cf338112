from django.db import migrations

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0027_group_policies")]
    operations = [
        apply_core_migrations(),  # ledger migration 0028_lost_books (a function only: no model changes)
    ]
