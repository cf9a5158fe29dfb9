"""The two rows every delivery writes lose the constraints PostgreSQL re-checks at each write.

- The counters and retry numbers become ``NonNegativeIntegerField``: still
  at least 0 for Django's validation, without ``CHECK (x >= 0)``, which
  PostgreSQL parses from its stored form at every statement that writes the row.
- The delivery log's ``outcome`` keeps its column and index without a foreign
  key constraint, which PostgreSQL checked at the commit of every claim by a
  query that locks the outcome row. Django still deletes an outcome's log with it.

On PostgreSQL both are catalog changes only (``DROP CONSTRAINT``), no table is rewritten;
SQLite rebuilds the two tables, as it does for any altered column.
Measured in docs/benchmarks.md.
"""

import django.db.models.deletion
import queueapp.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('queueapp', '0007_outcome_indexes'),
    ]

    operations = [
        migrations.AlterField(
            model_name='taskdelivery',
            name='delivery_count',
            field=queueapp.models.NonNegativeIntegerField(blank=True, help_text="Broker's delivery count of the message (1: first).", null=True, verbose_name='delivery count'),
        ),
        migrations.AlterField(
            model_name='taskdelivery',
            name='outcome',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.CASCADE, related_name='delivery_log', to='queueapp.taskoutcome', verbose_name='outcome'),
        ),
        migrations.AlterField(
            model_name='taskdelivery',
            name='retries',
            field=queueapp.models.NonNegativeIntegerField(default=0, help_text='Celery retry number.', verbose_name='retries'),
        ),
        migrations.AlterField(
            model_name='taskoutcome',
            name='attempts',
            field=queueapp.models.NonNegativeIntegerField(default=0, help_text='Times the body ran (first run, Celery retries and redeliveries that got to run).', verbose_name='attempts'),
        ),
        migrations.AlterField(
            model_name='taskoutcome',
            name='deferrals',
            field=queueapp.models.NonNegativeIntegerField(default=0, help_text='Deliveries given back to the broker with a higher token floor (e.g. after a failover).', verbose_name='deferrals'),
        ),
        migrations.AlterField(
            model_name='taskoutcome',
            name='deliveries',
            field=queueapp.models.NonNegativeIntegerField(default=0, help_text='Deliveries seen, duplicates and refusals included.', verbose_name='deliveries'),
        ),
        migrations.AlterField(
            model_name='taskoutcome',
            name='retries',
            field=queueapp.models.NonNegativeIntegerField(default=0, help_text='Celery retry number of the attempt that holds the key: an older attempt of the same task never takes it back.', verbose_name='retries'),
        ),
        migrations.AlterField(
            model_name='taskoutcome',
            name='stale_refusals',
            field=queueapp.models.NonNegativeIntegerField(default=0, help_text='Deliveries refused because a newer fencing token had been seen.', verbose_name='stale refusals'),
        ),
        migrations.AlterField(
            model_name='taskoutcome',
            name='suppressed_duplicates',
            field=queueapp.models.NonNegativeIntegerField(default=0, help_text='Deliveries suppressed because the key had already succeeded (or was dead).', verbose_name='suppressed duplicates'),
        ),
    ]
