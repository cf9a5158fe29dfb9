"""The bench's Redis CPU meter against a real redis-server: what it counts and what it takes off.

The CPU of a span is the server main thread's ``INFO cpu`` delta; the
harness's polls and the idle server's background work are measured on the
same server and subtracted. These tests check what the meter counts and the
arithmetic of what it takes off; how close the subtraction comes is the
bench's figure, not a test's (two samples of CPU time on a shared machine
differ by a quarter when idle, by more under load).
"""

from __future__ import annotations

import time

import pytest

from lab.bench.core import (
    FENCED,
    POLL_INTERVAL,
    STOCK,
    LoadMeter,
    commandstats,
    measure_harness_cpu,
    redis_cpu,
    remaining,
    remaining_commands,
    watch_drain,
)

COMMANDS = 5_000


def test_commands_between_start_and_stop_show_as_positive_cpu_per_message(redis_client):
    meter = LoadMeter(redis_client).start()
    pipe = redis_client.pipeline(transaction=False)
    for n in range(COMMANDS):
        pipe.set(f"k{n}", "x" * 100)
    pipe.execute()
    load = meter.stop()

    assert load.calls["set"] == COMMANDS
    assert load.calls.get("info") is None  # The meter's own INFO snapshots are not the run's.
    assert load.cpu_seconds > 0
    summary = load.summary(COMMANDS)
    assert summary["redis_cpu_us_per_message"] == pytest.approx(load.cpu_seconds * 1e6 / COMMANDS)
    # A SET costs Redis about a µs or more of CPU; far below 1 ms on any machine.
    assert 0.1 < summary["redis_cpu_us_per_message"] < 1_000


def test_the_idle_share_is_taken_off_in_proportion_to_the_span(redis_client):
    meter = LoadMeter(redis_client, idle_cpu_per_s=0.001).start()
    time.sleep(0.2)
    load = meter.stop()

    assert load.own_cpu_seconds == pytest.approx(0.001 * load.seconds)
    assert load.net_cpu_seconds == pytest.approx(load.cpu_seconds - load.own_cpu_seconds)
    summary = load.summary(10)
    assert summary["redis_cpu_us_per_message"] == pytest.approx(load.net_cpu_seconds * 1e6 / 10)
    assert summary["redis_cpu_us_subtracted"] == pytest.approx(load.own_cpu_seconds * 1e6, abs=0.1)


@pytest.mark.parametrize("system", [STOCK, FENCED])
def test_the_harness_s_polls_are_measured_and_subtracted(redis_server, redis_client, system):
    """The calibration replays the drain's polls, and a span of polls is charged exactly what it measured.

    Counts and arithmetic only: whether the calibrated share leaves a span of
    polls near zero compares two samples of CPU time, which on a shared
    machine differ by a quarter when idle and by more under load (the bench
    prints both figures, ``redis_cpu_us_measured`` and ``_subtracted``).
    """
    polls = int(0.5 / POLL_INTERVAL)
    before = commandstats(redis_client)
    harness = measure_harness_cpu(redis_client, (system,), seconds=0.5)
    after = commandstats(redis_client)
    sent = {name: after[name][0] - before.get(name, (0, 0))[0] for name in remaining_commands(system)}
    assert sent == {name: calls * polls for name, calls in remaining_commands(system).items()}
    assert harness.idle_per_s >= 0 and harness.per_poll[system] >= 0

    meter = LoadMeter(redis_client, harness.idle_per_s).start()
    cpu_before = redis_cpu(redis_client)
    for _ in range(polls):
        remaining(redis_client, system, "bench.polled")
        time.sleep(POLL_INTERVAL)
    polled = redis_cpu(redis_client) - cpu_before
    for name, calls in remaining_commands(system).items():
        meter.count_own(name, calls * polls)
    meter.count_own("info", 2)  # The two redis_cpu() readings above.
    meter.count_own_cpu(harness.per_poll[system] * polls)
    load = meter.stop()

    assert load.calls == {}  # Every command of the span was the harness's own.
    assert polled > 0  # A poll is a round trip of 3 to 12 commands: never free.
    assert load.cpu_seconds >= polled
    subtracted = harness.per_poll[system] * polls + harness.idle_per_s * load.seconds
    assert load.own_cpu_seconds == pytest.approx(subtracted)
    assert load.net_cpu_seconds == pytest.approx(load.cpu_seconds - subtracted)


def test_a_drain_is_metered_from_the_last_poll_that_found_every_message_unfetched(redis_client):
    """What a consumer sends before it takes the first message (its start-up) is not the drain's.

    The consumer runs between the harness's polls, deterministically: ``alive``
    is called once per poll, after it. Its start-up command goes out after the
    first poll, its takes after the second, which still finds every message.
    """
    queue, messages = "bench.metered", 50
    redis_client.rpush(queue, *range(messages))  # The stock layout: the list of priority step 0.
    steps = iter(
        [
            lambda: redis_client.set("bench.start-up", 1),
            lambda: [redis_client.lpop(queue) for _ in range(messages)],
        ]
    )

    def consumer_between_polls() -> bool:
        step = next(steps, None)
        if step is not None:
            step()
        return True

    drain = watch_drain(redis_client, STOCK, queue, messages, timeout=15, alive=consumer_between_polls)

    assert drain.load.calls["lpop"] == messages
    assert "set" not in drain.load.calls  # Sent before the last poll that saw every message still there.
