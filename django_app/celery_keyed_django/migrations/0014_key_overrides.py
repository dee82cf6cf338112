from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0013_generic_release_plans")]
    operations = [
        apply_core_migrations(),  # ledger migration 0014_key_overrides
        migrations.CreateModel(
            name="KeyOverride",
            fields=[
                ("key", models.TextField(primary_key=True, serialize=False)),
                ("name", models.TextField()),
                ("slot_limit", models.IntegerField(blank=True, null=True, verbose_name="key limit")),
                ("expires_at", models.DateTimeField(blank=True, null=True, verbose_name="limit expires")),
                ("reason", models.TextField(blank=True, null=True)),
                ("author", models.TextField()),
                ("set_at", models.DateTimeField(null=True)),
                ("paused_until", models.DateTimeField(blank=True, null=True)),
                ("pause_reason", models.TextField(blank=True, null=True)),
                ("pause_author", models.TextField()),
                ("paused_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "key override",
                "db_table": "keyed_key_overrides",
                "ordering": ("key",),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
