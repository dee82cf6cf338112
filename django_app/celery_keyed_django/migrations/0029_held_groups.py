# The admin's held groups page: a proxy of the groups model, with the permission to resume a held group or skip its
# failed head.
from django.db import migrations

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
            ],
            options={
                'verbose_name': 'held group',
                'ordering': ('held_since', 'group_key'),
                'permissions': (('release_groups', 'Can resume held groups and skip their failed heads'),),
                'proxy': True,
                'default_permissions': ('view',),
                'indexes': [],
                'constraints': [],
            },
            bases=('celery_keyed_django.group',),
        ),
    ]
