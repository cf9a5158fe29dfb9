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
