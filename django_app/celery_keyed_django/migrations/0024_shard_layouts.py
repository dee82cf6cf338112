from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0023_retry_outbox")]
    operations = [
        apply_core_migrations(),  # ledger migration 0024_shard_layouts
        migrations.AddField(
            model_name="slot",
            name="shards",
            field=models.IntegerField(help_text="the shard count this key's rows are laid out for"),
            preserve_default=False,
        ),
    ]
