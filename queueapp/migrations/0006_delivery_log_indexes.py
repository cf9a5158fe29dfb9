"""The delivery log keeps the indexes something reads: every delivery writes its row twice.

``outcome_id``'s own index is dropped (``queueapp_delivery_outcome_idx``,
``(outcome, -started_at)``, starts with the same column), by name: altering the
field would drop and re-add its foreign key, which on PostgreSQL checks every
row of the log while it blocks writes to it.
"""

import django.db.models.deletion
from django.db import migrations, models

OUTCOME_INDEX = "queueapp_taskdelivery_outcome_id_9ccb0514"  # Django's name for the field's index


class Migration(migrations.Migration):
    dependencies = [
        ("queueapp", "0005_delivery_lease_and_operator_actions"),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name="taskdelivery",
            name="queueapp_delivery_task_idx",
        ),
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f"DROP INDEX IF EXISTS {OUTCOME_INDEX}",
                    reverse_sql=f"CREATE INDEX {OUTCOME_INDEX} ON queueapp_taskdelivery (outcome_id)",
                ),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name="taskdelivery",
                    name="outcome",
                    field=models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="delivery_log",
                        to="queueapp.taskoutcome",
                        verbose_name="outcome",
                    ),
                ),
            ],
        ),
    ]
