from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0025_failover")]
    operations = [
        apply_core_migrations(),  # ledger migration 0026_canvas_message
        migrations.AddField(
            model_name="taskrecord",
            name="message",
            field=models.JSONField(
                help_text="the stored message of a parked task that never ran, kept until its result is stored",
                null=True,
            ),
        ),
    ]
