from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0015_newest_wins")]
    operations = [
        apply_core_migrations(),  # ledger migration 0016_fair_weights
        migrations.CreateModel(
            name="FairWeightLog",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.TextField()),
                ("prefix", models.TextField()),
                ("action", models.TextField()),
                ("old_weight", models.FloatField(null=True)),
                ("new_weight", models.FloatField(null=True)),
                ("reason", models.TextField()),
                ("author", models.TextField()),
                ("expires_at", models.DateTimeField(null=True)),
                ("at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "fair weight change",
                "verbose_name_plural": "fair weight changes",
                "db_table": "keyed_fair_weight_log",
                "ordering": ("-at", "-id"),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        migrations.CreateModel(
            name="FairWeightOverride",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.TextField()),
                ("prefix", models.TextField(verbose_name="fair-key prefix")),
                ("weight", models.FloatField()),
                ("reason", models.TextField()),
                ("author", models.TextField()),
                ("expires_at", models.DateTimeField(blank=True, null=True)),
                ("set_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "fair weight override",
                "db_table": "keyed_fair_weight_overrides",
                "ordering": ("name", "prefix"),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
