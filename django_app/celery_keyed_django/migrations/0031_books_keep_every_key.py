from django.contrib.postgres.fields import ArrayField
from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0030_guard_reads_the_server_once")]
    operations = [
        apply_core_migrations(),  # ledger migration 0031_books_keep_every_key
        migrations.AddField(
            model_name="taskrecord",
            name="extra_keys",
            field=ArrayField(base_field=models.TextField(), null=True, size=None),
        ),
    ]
