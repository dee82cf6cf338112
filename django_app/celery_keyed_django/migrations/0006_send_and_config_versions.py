from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0005_server_paths")]
    operations = [
        apply_core_migrations(),  # ledger migration 0006_send_and_config_versions
        migrations.AddField(
            model_name="name",
            name="config_version",
            field=models.IntegerField(
                "configuration version",
                help_text="keyed_config_version of the worker that stored it (older never overwrite)",
            ),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="holder",
            name="config_version",
            field=models.IntegerField("configuration version", null=True),
        ),
        migrations.AlterModelOptions(
            name="holder",
            options={
                "default_permissions": ("view",),
                "managed": False,
                "ordering": ("-started_at",),
                "verbose_name": "worker",
            },
        ),
        migrations.CreateModel(
            name="SendRefusals",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "name", "reason", blank=True, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("name", models.TextField()),
                (
                    "reason",
                    models.TextField(choices=[("room_full", "waiting room full"), ("duplicate", "dedupe key live")]),
                ),
                ("refused", models.BigIntegerField()),
                ("last_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "refused sends",
                "verbose_name_plural": "refused sends",
                "db_table": "keyed_send_refusals",
                "ordering": ("name", "reason"),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="Sent",
            fields=[
                ("task_id", models.TextField(primary_key=True, serialize=False)),
                ("key", models.TextField()),
                ("dedupe_key", models.TextField(null=True)),
                ("sent_at", models.DateTimeField()),
                ("expires_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "accepted send",
                "db_table": "keyed_sent",
                "ordering": ("-sent_at",),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
