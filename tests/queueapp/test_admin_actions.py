"""The admin's actions through Django's test client: confirmed, then done, logged and permission-checked."""

from __future__ import annotations

import json

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import User
from django.urls import reverse

from broker_ext.queue import FencedQueue
from broker_ext.records import Place
from queueapp.admin.pages import dead_letter_value
from queueapp.models import TaskOutcome
from tests.queueapp import scenarios

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgres_too,
    pytest.mark.usefixtures("fast_password_hashing"),
]

CHANGELIST = reverse("admin:queueapp_taskoutcome_changelist")
REQUEUE_DEAD_LETTERS = reverse("admin:queueapp_taskoutcome_requeue_dead_letters")
Status = TaskOutcome.Status


def act(client, action: str, *outcomes: TaskOutcome, confirm: bool = False):
    data = {"action": action, "_selected_action": [o.pk for o in outcomes]}
    if confirm:
        data["post"] = "yes"
    return client.post(CHANGELIST, data, follow=confirm)


def messages_of(response) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def place(queue: FencedQueue, published: scenarios.Published) -> Place:
    message_id = published.outcome().message_id or published.message_id
    return queue.locate([message_id])[message_id].place


def test_requeue_asks_for_confirmation_showing_the_plan_and_changes_nothing_yet(admin_client, queue, effects):
    dead = scenarios.dead_lettered(queue, "poisoned")
    done = scenarios.succeeded(queue, "paid")
    response = act(admin_client, "requeue_selected", dead.outcome(), done.outcome())
    assert response.status_code == 200
    assert response.templates[0].name == "admin/queueapp/taskoutcome/confirm_action.html"
    plan = {result.key: result.step.value for result in response.context["results"]}
    assert plan == {dead.key: "revive", done.key: "skip"}
    assert "never run again" in response.content.decode()
    assert place(queue, dead) is Place.DEAD
    assert not LogEntry.objects.exists()


def test_confirmed_requeue_revives_logs_and_reports(admin_client, queue, effects):
    dead = scenarios.dead_lettered(queue, "poisoned")
    done = scenarios.succeeded(queue, "paid")
    response = act(admin_client, "requeue_selected", dead.outcome(), done.outcome(), confirm=True)
    assert response.redirect_chain[-1][0].startswith(CHANGELIST)
    assert place(queue, dead) is Place.READY
    assert done.outcome().status == Status.SUCCEEDED
    (entry,) = LogEntry.objects.all()
    assert (entry.object_id, entry.action_flag) == (str(dead.outcome().pk), CHANGE)
    assert "revived" in entry.change_message
    shown = messages_of(response)
    assert shown[0] == "Requeue: 1 done, 1 skipped, 0 failed."
    assert any("already succeeded" in message for message in shown)


def test_mark_dead_dead_letters_the_message_and_names_the_operator(admin_client, admin_user, queue):
    queued = scenarios.publish(scenarios.demo_tasks.effect, "cancel me")
    act(admin_client, "mark_dead", queued.outcome(), confirm=True)
    assert queued.outcome().status == Status.DEAD
    state = queue.locate([queued.message_id])[queued.message_id]
    assert state.place is Place.DEAD and admin_user.username in state.reason
    assert "marked dead" in LogEntry.objects.get().change_message


def test_requeue_dead_lettered_revives_only_the_selected_keys_dead_letters(admin_client, queue, effects):
    dead = scenarios.dead_lettered(queue, "poisoned")
    failed = scenarios.failed(queue, "declined")
    response = act(admin_client, "requeue_dead_lettered", dead.outcome(), failed.outcome(), confirm=True)
    assert place(queue, dead) is Place.READY
    assert failed.outcome().status == Status.FAILED  # its message is not dead-lettered: skipped
    assert messages_of(response)[0] == "Requeue dead-lettered: 1 done, 1 skipped, 0 failed."


def test_the_stuck_page_requeues_ticked_dead_letters_after_confirmation(admin_client, queue, effects):
    dead = scenarios.dead_lettered(queue, "poisoned")
    value = dead_letter_value(scenarios.QUEUE, dead.message_id)
    confirm = admin_client.post(REQUEUE_DEAD_LETTERS, {"message": [value]})
    assert confirm.status_code == 200 and place(queue, dead) is Place.DEAD
    assert [r.step.value for r in confirm.context["results"]] == ["revive"]
    response = admin_client.post(REQUEUE_DEAD_LETTERS, {"message": [value], "post": "yes"}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("admin:queueapp_taskoutcome_stuck")
    assert place(queue, dead) is Place.READY
    assert dead.outcome().status == Status.QUEUED
    assert "revived" in LogEntry.objects.get().change_message


def test_a_dead_letter_without_an_outcome_is_logged_on_the_message(admin_client, queue):
    from settings.celery import app

    app.send_task("lab.noop", args=[1])
    (claimed,) = queue.claim(1)
    queue.dead_letter([claimed.delivery], "rejected")
    value = dead_letter_value(scenarios.QUEUE, claimed.delivery.message_id)
    admin_client.post(REQUEUE_DEAD_LETTERS, {"message": [value], "post": "yes"})
    entry = LogEntry.objects.get()
    assert entry.object_id is None and entry.object_repr == f"celery/{claimed.delivery.message_id}"


def test_staff_without_the_requeue_permission_is_not_offered_the_action_and_cannot_force_it(client, queue):
    dead = scenarios.dead_lettered(queue, "poisoned")
    before = dead.outcome().status  # dead already: the broker's dead-lettering is recorded on the row
    client.force_login(scenarios.staff("viewer", "view_taskoutcome"))
    assert client.get(CHANGELIST).context["action_form"] is None  # no action is offered at all
    for action in ("requeue_selected", "mark_dead", "requeue_dead_lettered"):
        act(client, action, dead.outcome(), confirm=True)
    value = dead_letter_value(scenarios.QUEUE, dead.message_id)
    assert client.post(REQUEUE_DEAD_LETTERS, {"message": [value], "post": "yes"}).status_code == 403
    assert place(queue, dead) is Place.DEAD
    assert dead.outcome().status == before
    assert not LogEntry.objects.exists()


def test_each_action_needs_its_own_permission(client, queue):
    dead = scenarios.dead_lettered(queue, "poisoned")
    client.force_login(scenarios.staff("requeuer", "view_taskoutcome", "requeue_taskoutcome"))
    choices = dict(client.get(CHANGELIST).context["action_form"].fields["action"].choices)
    assert {"requeue_selected", "requeue_dead_lettered"} <= set(choices) and "mark_dead" not in choices
    before = dead.outcome().updated_at
    act(client, "mark_dead", dead.outcome(), confirm=True)
    assert dead.outcome().updated_at == before
    act(client, "requeue_selected", dead.outcome(), confirm=True)
    assert place(queue, dead) is Place.READY


def test_a_user_who_is_not_staff_cannot_post_an_action(client, queue):
    dead = scenarios.dead_lettered(queue, "poisoned")
    client.force_login(User.objects.create_user("visitor"))
    response = act(client, "requeue_selected", dead.outcome(), confirm=True)
    assert response.redirect_chain[-1][0].startswith(reverse("admin:login"))
    value = json.dumps([scenarios.QUEUE, dead.message_id])
    response = client.post(REQUEUE_DEAD_LETTERS, {"message": [value], "post": "yes"})
    assert response.status_code == 302 and response.url.startswith(reverse("admin:login"))
    assert place(queue, dead) is Place.DEAD
