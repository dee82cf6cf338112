# The admin's held groups page: an unmanaged model over keyed_groups, with the permission to resume a held group or
# skip its failed head.
from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [
        ('celery_keyed_django', '0028_lost_books'),
    ]

    operations = [
        apply_core_migrations(),  # ledger migration 0029_held_groups (a table comment)
        migrations.CreateModel(
            name='HeldGroup',
            fields=[
                ('group_key', models.TextField(primary_key=True, serialize=False)),
                ('next_seq', models.BigIntegerField()),
                ('held_since', models.DateTimeField(null=True)),
                ('held_task_id', models.TextField(null=True, verbose_name='failed head')),
                ('held_reason', models.TextField(null=True, verbose_name='why')),
            ],
            options={
                'verbose_name': 'held group',
                'db_table': 'keyed_groups',
                'ordering': ('held_since', 'group_key'),
                'permissions': (('release_groups', 'Can resume held groups and skip their failed heads'),),
                'managed': False,
                'default_permissions': ('view',),
            },
        ),
    ]
