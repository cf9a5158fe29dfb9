"""The cluster level's two targets, computed from figures (the figures themselves: ``test_bench``)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from kombu import Producer

from lab.bench.cluster_level import (
    LONE,
    SHARDED,
    SPLIT,
    ClusterBench,
    core_plan,
    publish_all,
    ratio,
    spread,
    warm_up,
)
from lab.bench.core import Measurement


def _run() -> SimpleNamespace:
    """What ``ClusterBench.start`` reads of a bench run."""
    return SimpleNamespace(started_pids=[], progress=lambda line: None)


def test_the_spread_is_the_farthest_master_from_an_even_share_of_the_sum():
    assert spread({"A": 10.0, "B": 10.0, "C": 10.0}) == 0
    assert spread({"A": 11.0, "B": 10.0, "C": 9.0}) == pytest.approx(0.1)
    assert spread({"A": 30.0, "B": 0.0, "C": 0.0}) == pytest.approx(2.0)  # One master does it all.
    assert spread({"A": 0.0, "B": 0.0, "C": 0.0}) is None


def test_the_cost_ratio_pairs_the_settings_round_by_round():
    """A load that hit one round hits every setting of it: the median of the per-round ratios ignores it,
    where the ratio of the medians would not."""
    figure = Measurement("cluster.cpu.publish", "cluster", "publish", "µs/msg")
    for split, sharded in ((50.0, 55.0), (100.0, 110.0), (52.0, 57.2), (90.0, 99.0), (48.0, 52.8)):
        figure.add(SPLIT.key, split)
        figure.add(SHARDED.key, sharded)
    assert ratio(figure, SHARDED, SPLIT) == pytest.approx(1.1)
    assert ratio(figure, SHARDED, LONE) is None
    figure.repeats[SHARDED.key].pop()  # A failed round: the ratio of the medians instead.
    assert ratio(figure, SHARDED, SPLIT) == pytest.approx(
        figure.values[SHARDED.key] / figure.values[SPLIT.key]
    )


@pytest.mark.slow
@pytest.mark.parametrize("setting", [SPLIT, SHARDED], ids=lambda setting: setting.key)
def test_a_publish_figure_starts_once_every_queue_and_shard_is_past_the_small_hash_encoding(setting):
    """A fresh queue's ``state`` is a listpack up to ``hash-max-listpack-entries``, scanned on every write;
    a shard, a sixth of the queue, stays there longer than a third of it would. The warm-up publishes
    until no queue or shard is: what a figure then measures is a hot queue's cost."""
    bench = ClusterBench.start(_run())
    try:
        small = int(
            next(iter(bench.masters.values())).config_get("hash-max-listpack-entries")[
                "hash-max-listpack-entries"
            ]
        )
        queues = bench.queues("publish", setting)
        with bench.connection(setting) as connection:
            for queue in queues:
                queue(connection.default_channel).declare()
            producer = Producer(connection.default_channel)
            publish_all(producer, queues, 0, 20)
            assert not bench.hot(setting)
            published = warm_up(bench, setting, producer, queues, 20)
        states = [
            (client.object("encoding", key), client.hlen(key))
            for client in bench.masters.values()
            for key in client.scan_iter(match="*fenced:*:state")
        ]
        assert len(states) == setting.queues * setting.shards
        assert all(encoding == b"hashtable" and length > small for encoding, length in states), states
        assert bench.remaining() == published + 20
    finally:
        bench.stop()


def test_the_bench_process_gets_the_last_core_and_the_masters_every_other_one():
    assert core_plan({0, 1}) == ({0}, {1})
    assert core_plan({0, 1, 2, 3}) == ({0, 1, 2}, {3})
    assert core_plan({2, 5, 7}) == ({2, 5}, {7})
    assert core_plan({0}) is None  # One core: nothing to keep apart.


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="no CPU affinity here, or one core: the level does not pin",
)
def test_the_masters_run_off_the_bench_process_core_until_the_level_stops():
    """The bench's Python would otherwise preempt the masters and be charged to Redis as its CPU."""
    before = os.sched_getaffinity(0)
    masters, bench_core = core_plan(before)
    bench = ClusterBench.start(_run())
    try:
        if bench.unpinned is None:
            pytest.skip("the system refused to pin (the level runs unpinned and says so)")
        assert os.sched_getaffinity(0) == bench_core
        assert bench.cores == {"masters": sorted(masters), "bench": sorted(bench_core)}
        pids = [node.pid for node in bench.cluster.nodes]
        assert pids and all(os.sched_getaffinity(pid) == masters for pid in pids)
    finally:
        bench.stop()
    assert os.sched_getaffinity(0) == before
