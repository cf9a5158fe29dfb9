"""The outcome row keeps the indexes something reads: every delivery writes it twice.

``status`` and ``last_started_at`` change at every claim and every success, so
each index on them is rewritten twice per delivery (on PostgreSQL every index
of the row is, as such an update is never HOT). Two of them served no query:

- ``queueapp_outcome_status_idx`` ``(status, -last_started_at)``: nothing
  orders by ``last_started_at``; status filters use ``queueapp_outcome_lease_idx``
  ``(status, lease_deadline)``, which starts with the same column;
- ``queueapp_outcome_started_idx`` ``(-last_started_at)``: nothing orders or
  filters by it.

PostgreSQL's ``varchar_pattern_ops`` index Django adds beside the unique key
serves only case-sensitive ``LIKE 'prefix%'``, which nothing runs (the admin
searches with ``icontains``, ``manage.py`` with ``istartswith``): dropped by
name. The unique constraint itself stays.
"""

from django.db import migrations, models


def like_index(schema_editor) -> str:
    """The name Django gave the ``varchar_pattern_ops`` index of ``idempotency_key`` (PostgreSQL)."""
    return schema_editor._create_index_name("queueapp_taskoutcome", ["idempotency_key"], suffix="_like")


def drop_like_index(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f"DROP INDEX IF EXISTS {schema_editor.quote_name(like_index(schema_editor))}")


def restore_like_index(apps, schema_editor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"CREATE INDEX IF NOT EXISTS {schema_editor.quote_name(like_index(schema_editor))} "
            "ON queueapp_taskoutcome (idempotency_key varchar_pattern_ops)"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("queueapp", "0006_delivery_log_indexes"),
    ]

    operations = [
        migrations.RemoveIndex(model_name="taskoutcome", name="queueapp_outcome_status_idx"),
        migrations.RemoveIndex(model_name="taskoutcome", name="queueapp_outcome_started_idx"),
        migrations.RunPython(drop_like_index, restore_like_index, elidable=False),
    ]
