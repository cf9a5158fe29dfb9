"""The lab's effect rows in the admin, through Django's test client on a real database."""

from __future__ import annotations

import pytest
from django.urls import reverse

from lab.models import Effect

pytestmark = [pytest.mark.django_db, pytest.mark.postgres_too]

CHANGELIST = "admin:lab_effect_changelist"


@pytest.fixture
def demo_effects() -> dict[str, list[Effect]]:
    """One demo's two runs: the stock run committed ``t00001`` twice, the fenced run once, same label."""
    return {
        "stock double": [
            Effect.objects.create(run="fl-demo-stock", label="t00001", worker="w1"),
            Effect.objects.create(run="fl-demo-stock", label="t00001", worker="w2"),
        ],
        "stock once": [Effect.objects.create(run="fl-demo-stock", label="t00002")],
        "fenced once": [
            Effect.objects.create(run="fl-demo-fenced", label="t00001", token=3),
            Effect.objects.create(run="fl-demo-fenced", label="t00002", token=1),
        ],
    }


def listed(response) -> set[int]:
    return {effect.pk for effect in response.context["cl"].result_list}


def test_doubled_lists_the_rows_of_a_label_committed_twice_in_its_run_only(admin_client, demo_effects):
    response = admin_client.get(f"{reverse(CHANGELIST)}?doubled=yes")

    assert response.status_code == 200
    assert listed(response) == {effect.pk for effect in demo_effects["stock double"]}


def test_doubled_and_run_narrow_together(admin_client, demo_effects):
    fenced = admin_client.get(f"{reverse(CHANGELIST)}?doubled=yes&run=fl-demo-fenced")
    stock = admin_client.get(f"{reverse(CHANGELIST)}?doubled=yes&run=fl-demo-stock")
    everything = admin_client.get(reverse(CHANGELIST))

    assert listed(fenced) == set()
    assert listed(stock) == {effect.pk for effect in demo_effects["stock double"]}
    assert len(listed(everything)) == 5


def test_the_demo_forgets_earlier_lab_runs_and_keeps_everything_else(django_user_model):
    """On its SQLite database the demo starts from no lab rows, so its admin counts one run."""
    from lab.faultlab import database
    from queueapp.models import TaskDelivery, TaskOutcome

    django_user_model.objects.create_superuser("operator", "operator@example.com", "pw")
    earlier = TaskOutcome.objects.create(
        idempotency_key="fl-old-fenced-t00001", task_name="lab.fenced_effect", task_id="fl-old-fenced-t00001"
    )
    TaskDelivery.objects.create(outcome=earlier, task_id=earlier.task_id, fence_token=1)
    mine = TaskOutcome.objects.create(idempotency_key="order-7", task_name="shop.pay", task_id="fl-like-id")
    Effect.objects.create(run="fl-old-stock", label="t00001")
    Effect.objects.create(run="bench-1", label="t00001")

    database.forget_earlier_runs()

    if database.connection.vendor == "sqlite":
        assert list(TaskOutcome.objects.all()) == [mine]
        assert not TaskDelivery.objects.exists()
        assert list(Effect.objects.values_list("run", flat=True)) == ["bench-1"]
    else:  # A shared database keeps every run: others may be reading it.
        assert TaskOutcome.objects.count() == 2 and Effect.objects.count() == 2
    assert django_user_model.objects.filter(username="operator").exists()
