from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0007_release_and_promote")]
    operations = [
        apply_core_migrations(),  # ledger migration 0008_outbox
        migrations.CreateModel(
            name="Outbox",
            fields=[
                ("task_id", models.TextField(primary_key=True, serialize=False)),
                ("task_name", models.TextField()),
                ("key", models.TextField(null=True)),
                ("group_key", models.TextField(null=True)),
                ("message", models.JSONField()),
                ("registered_at", models.DateTimeField()),
                ("due_at", models.DateTimeField()),
                ("pending", models.BooleanField()),
                ("republished", models.IntegerField()),
                ("republished_at", models.DateTimeField(null=True)),
            ],
            options={
                "verbose_name": "registered message not received",
                "verbose_name_plural": "outbox: registered, not received",
                "db_table": "keyed_outbox",
                "ordering": ("registered_at",),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
