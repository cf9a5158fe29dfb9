"""The app's plumbing: migrations, lazy settings, the decorator on task objects, publish-time dedup."""

from __future__ import annotations

import io

import pytest
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from broker_ext.queue import FencedQueue
from queueapp import conf, exactly_once, queued
from queueapp.errors import ConfigurationError
from queueapp.models import NonNegativeIntegerField, TaskDelivery, TaskOutcome
from tests.queueapp import demo_tasks


@pytest.mark.django_db
def test_no_model_change_is_missing_a_migration():
    out = io.StringIO()
    call_command("makemigrations", "queueapp", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


@pytest.mark.django_db
@pytest.mark.postgres_too
def test_the_rows_every_delivery_writes_carry_no_constraint_the_database_checks_at_each_write():
    """No foreign key, and no CHECK on a counter, on the outcome and delivery tables.

    (SQLite's JSON columns keep their ``json_valid`` checks: SQLite compiles a
    table's checks once per prepared statement, not at each execution.)
    """
    with connection.cursor() as cursor:
        for model in (TaskOutcome, TaskDelivery):
            counters = {f.column for f in model._meta.fields if isinstance(f, NonNegativeIntegerField)}
            assert counters
            constraints = connection.introspection.get_constraints(cursor, model._meta.db_table)
            checked = {
                name: c
                for name, c in constraints.items()
                if c["foreign_key"] or (c["check"] and counters & set(c["columns"]))
            }
            assert not checked, (model.__name__, checked)


@pytest.mark.django_db
@pytest.mark.postgres_too
def test_counters_are_still_validated_and_an_outcomes_log_is_deleted_with_it():
    outcome = TaskOutcome.objects.create(idempotency_key="k", task_name="t", attempts=-1)
    with pytest.raises(ValidationError) as raised:
        outcome.full_clean()
    assert set(raised.value.message_dict) == {"attempts"}
    TaskDelivery.objects.create(outcome=outcome, fence_token=1, retries=0)
    outcome.delete()
    assert not TaskDelivery.objects.exists()


def test_settings_are_read_when_used_not_at_import():
    assert conf.get("DEFER_DELAY") == conf.DEFAULTS["DEFER_DELAY"]
    with override_settings(QUEUEAPP={"DEFER_DELAY": 7, "TYPO": 1}):
        assert conf.get("DEFER_DELAY") == 7
        assert conf.unknown_keys() == ["TYPO"]
    with pytest.raises(ConfigurationError, match="unknown queueapp setting"):
        conf.get("NOPE")


def test_a_changed_queueapp_setting_is_seen_at_the_next_lookup(settings):
    """The dict is kept between lookups (a hot path asks several times per task) until it changes."""
    settings.QUEUEAPP = {"DEFER_DELAY": 3}
    assert conf.get("DEFER_DELAY") == 3
    settings.QUEUEAPP = {"DEFER_DELAY": 4}
    assert conf.get("DEFER_DELAY") == 4
    settings.QUEUEAPP = {}
    assert conf.get("DEFER_DELAY") == conf.DEFAULTS["DEFER_DELAY"]


@pytest.mark.django_db(transaction=True)
def test_the_decorator_over_a_task_object_of_a_finalized_app(effects):
    from settings.celery import app

    assert app.finalized

    @exactly_once(key=lambda label: f"dynamic:{label}")
    @app.task(bind=True, name="tests.queueapp.dynamic")
    def dynamic(self, label):
        demo_tasks.record_effect(label)
        return self.idempotency_key

    assert dynamic.apply(("x",)).result == "dynamic:x"
    assert dynamic.apply(("x",)).result == "dynamic:x"
    assert len(effects()) == 1


@pytest.mark.django_db(transaction=True)
def test_a_dedup_window_drops_the_second_publish_at_the_broker(redis_server, redis_db):
    queue = FencedQueue(redis_server.client(db=redis_db), "celery")
    first, second = demo_tasks.refund.delay(3), demo_tasks.refund.delay(3)
    assert first.id != second.id
    assert queue.stats().ready == 1
    assert queued.flush()  # Both records in one batch: the first one's row stays.
    assert TaskOutcome.objects.get(idempotency_key="refund:3").task_id == first.id
