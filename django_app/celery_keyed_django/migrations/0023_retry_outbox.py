from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0022_durable_batches")]
    operations = [
        apply_core_migrations(),  # ledger migration 0023_retry_outbox
        migrations.AlterField(
            model_name="outbox",
            name="message",
            field=models.JSONField(null=True),
        ),
        migrations.AddField(
            model_name="outbox",
            name="attempt",
            field=models.IntegerField(default=0),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="outbox",
            name="reported",
            field=models.BooleanField(default=False),
            preserve_default=False,
        ),
    ]
