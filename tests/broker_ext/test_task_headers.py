"""The worker's up-front header checks: never raise, and what they let through Celery's main process can use.

In process, with Hypothesis: any JSON a producer can put in ``task``,
``timelimit``, ``eta`` and ``expires``. Whatever :func:`header_problem` does
not refuse must survive what Celery's main process does with it (the time
limits added to a clock, the dates parsed and turned into timestamps); what
it refuses gets a reason that names the header.
"""

from __future__ import annotations

import time
from datetime import UTC

from celery.utils.time import maybe_iso8601, timezone
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.asynchronous.timer import to_timestamp

from broker_ext.task_headers import header_problem

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=2)
    ),
    max_leaves=6,
)
dates = (
    st.just("")
    | st.datetimes().map(lambda d: d.isoformat())
    | st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat())
)
headers = st.fixed_dictionaries(
    {"task": st.one_of(st.just("lab.fenced_effect"), json_values)},
    optional={
        "timelimit": st.one_of(
            st.lists(st.one_of(st.none(), st.floats(), st.integers()), max_size=3), json_values
        ),
        "eta": st.one_of(dates, json_values),
        "expires": st.one_of(dates, json_values),
    },
)


def celery_main_process_uses(checked: dict) -> None:
    """What Celery's consumer and prefork pool do with these headers before the task's code runs."""
    hard, soft = checked.get("timelimit") or (None, None)
    for limit in (hard, soft):
        if limit:
            time.monotonic() + limit  # billiard's timer
            time.time() + float(limit)  # kombu's timer
    for name in ("eta", "expires"):
        if checked.get(name):
            when = maybe_iso8601(checked[name])
            to_timestamp(timezone.to_system(when if when.tzinfo else when.replace(tzinfo=UTC)))


# Derandomized: the same examples in every run of the suite; a random run found the empty eta that
# crashed the check (now test_an_empty_date_is_no_date below).
@settings(max_examples=600, deadline=None, derandomize=True)
@given(headers)
def test_what_the_checks_let_through_celery_s_main_process_can_use(found):
    problem = header_problem(found)
    if problem is None:
        celery_main_process_uses(found)
    else:
        assert problem.startswith("header ") and any(name in problem for name in found), problem


def test_a_message_without_a_task_header_is_left_to_celery_s_own_handling():
    assert header_problem({"id": "x"}) is None
    assert header_problem(None) is None


def test_an_empty_date_is_no_date_as_for_celery():
    for name in ("eta", "expires"):
        for empty in ("", [], 0, None):
            assert header_problem({"task": "t", name: empty}) is None
