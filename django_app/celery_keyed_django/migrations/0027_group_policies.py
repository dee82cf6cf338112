from django.db import migrations, models

from celery_keyed_django.schema import apply_core_migrations


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("celery_keyed_django", "0026_canvas_message")]
    operations = [
        apply_core_migrations(),  # ledger migration 0027_group_policies
        migrations.AddField(
            model_name="name",
            name="group_failure",
            field=models.TextField(
                default="halt",
                help_text="what a group of this name does when its head fails: halt, skip or hold",
            ),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="group",
            name="held_since",
            field=models.DateTimeField(
                blank=True, help_text="held for an operator since (group_failure hold)", null=True
            ),
        ),
        migrations.AddField(
            model_name="group",
            name="held_task_id",
            field=models.TextField(blank=True, help_text="the head whose failure held the group", null=True),
        ),
        migrations.AddField(
            model_name="group",
            name="held_reason",
            field=models.TextField(blank=True, null=True),
        ),
    ]
