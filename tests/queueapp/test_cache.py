"""The django-redis fast path: a cached success suppresses without the row lock; no cache, same outcome."""

from __future__ import annotations

import uuid

import pytest
from django.core.cache import cache

from lab.redis_servers import free_port
from queueapp.cache import cache_key, succeeded
from queueapp.models import TaskDelivery, TaskOutcome
from tests.queueapp import demo_tasks

pytestmark = pytest.mark.django_db(transaction=True)


def deliver_twice(label: str) -> tuple[str, list]:
    """Run one key, then deliver it again; returns the key and both results."""
    task_id = str(uuid.uuid4())
    first = demo_tasks.effect.apply((label,), task_id=task_id)
    second = demo_tasks.effect.apply((label,), task_id=task_id)
    return task_id, [first.result, second.result]


def outcome_summary(key: str) -> tuple:
    outcome = TaskOutcome.objects.get(idempotency_key=key)
    verdicts = list(outcome.delivery_log.order_by("id").values_list("verdict", flat=True))
    return outcome.status, outcome.deliveries, outcome.suppressed_duplicates, outcome.attempts, verdicts


def test_a_committed_success_is_cached_and_a_duplicate_is_suppressed_from_the_cache(effects):
    key, (first, second) = deliver_twice("cached")
    assert succeeded(key).result == first == second
    assert len(effects()) == 1
    duplicate = TaskDelivery.objects.filter(outcome__idempotency_key=key).order_by("id").last()
    assert duplicate.verdict == TaskDelivery.Verdict.SUPPRESSED_DUPLICATE
    assert duplicate.detail == "key already succeeded (cache)"


def test_a_failed_run_is_never_cached(effects):
    result = demo_tasks.always_fails.apply(("nope",))
    assert succeeded(result.id) is None


def test_a_flushed_cache_changes_nothing_but_the_path(effects, redis_client):
    key, results = deliver_twice("flushed-before")
    reference = outcome_summary(key)
    cache.clear()
    assert cache.get(cache_key(key)) is None
    third = demo_tasks.effect.apply(("flushed-before",), task_id=key)
    assert third.result == results[0]
    status, deliveries, suppressed, attempts, verdicts = outcome_summary(key)
    assert (status, attempts) == (reference[0], reference[3])
    assert (deliveries, suppressed) == (3, 2)
    assert verdicts[-1] == TaskDelivery.Verdict.SUPPRESSED_DUPLICATE
    assert len(effects()) == 1
    assert succeeded(key) is not None  # The database answer warmed the cache again.


@pytest.mark.parametrize("ignore_exceptions", [True, False])
def test_an_unreachable_cache_gives_the_same_results(effects, settings, ignore_exceptions):
    with_cache_key, _ = deliver_twice("reachable")
    reference = outcome_summary(with_cache_key)
    settings.CACHES = {
        "default": {
            **settings.CACHES["default"],
            "LOCATION": f"redis://127.0.0.1:{free_port()}/0",
            "OPTIONS": {
                **settings.CACHES["default"]["OPTIONS"],
                "IGNORE_EXCEPTIONS": ignore_exceptions,
            },
        }
    }
    settings.DJANGO_REDIS_IGNORE_EXCEPTIONS = ignore_exceptions
    without_key, without_cache = deliver_twice("unreachable")
    assert [r["label"] for r in without_cache] == ["unreachable", "unreachable"]
    assert without_cache[0] == without_cache[1]
    summary = outcome_summary(without_key)
    assert summary[:4] == reference[:4]
    assert [row[0] for row in effects()] == ["reachable", "unreachable"]


def test_cache_off_gives_the_same_results(effects, settings):
    settings.QUEUEAPP = {"CACHE": None}
    key, (first, second) = deliver_twice("no-cache")
    assert first == second and len(effects()) == 1
    assert outcome_summary(key)[2] == 1
