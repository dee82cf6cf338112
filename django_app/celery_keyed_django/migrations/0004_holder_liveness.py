import django.contrib.postgres.fields
from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0003_books_retention")]
    operations = [
        apply_core_migrations(),  # ledger migration 0004_holder_liveness
        migrations.AddField(
            model_name='holder',
            name='machine',
            field=models.TextField(null=True),
        ),
        migrations.AddField(
            model_name='holder',
            name='pids',
            field=django.contrib.postgres.fields.ArrayField(base_field=models.IntegerField(), null=True, size=None),
        ),
    ]
