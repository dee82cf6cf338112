from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0024_shard_layouts")]
    operations = [
        apply_core_migrations(),  # ledger migration 0025_failover
        migrations.CreateModel(
            name="LedgerIdentity",
            fields=[
                ("one_row", models.BooleanField(default=True, primary_key=True, serialize=False)),
                ("system_identifier", models.BigIntegerField()),
                ("timeline", models.IntegerField()),
                ("postmaster_start", models.DateTimeField()),
                ("seen_at", models.DateTimeField()),
                ("hold_until", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "ledger identity",
                "verbose_name_plural": "ledger identity",
                "db_table": "keyed_ledger_identity",
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
