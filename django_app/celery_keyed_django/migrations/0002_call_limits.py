# The ledger's migration 0002_call_limits (limits computed from the call), applied by the core.

from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False  # the core's migrations run on a connection of their own, each in its own transaction

    dependencies = [
        ("celery_keyed_django", "0001_initial"),
    ]

    operations = [
        apply_core_migrations(),  # ledger migration 0002_call_limits
        migrations.CreateModel(
            name='CallLimit',
            fields=[
                ('key', models.TextField(primary_key=True, serialize=False)),
                ('name', models.TextField()),
                ('slot_limit', models.IntegerField(verbose_name='limit from the call')),
                ('set_at', models.DateTimeField()),
                ('task_id', models.TextField()),
                ('seen_at', models.DateTimeField()),
            ],
            options={
                'db_table': 'keyed_call_limits',
                'default_permissions': (),
                'managed': False,
            },
        ),
    ]
