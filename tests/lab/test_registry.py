"""The fault registry is the one declaration of a fault kind: everything else is derived from it."""

from __future__ import annotations

from pathlib import Path

from lab.faultlab import registry
from lab.faultlab.registry import FAULTS, FaultKind, kinds_on
from lab.faultlab.topology import ClusterRedis, SentinelRedis, SingleRedis

DOCS = Path(__file__).resolve().parents[2] / "docs" / "fault-lab.md"


def test_the_fault_table_in_the_docs_is_the_one_the_registry_declares():
    assert registry.markdown_table() in DOCS.read_text()


def test_every_declared_kind_has_a_name_a_description_an_injector_and_a_place_to_run():
    assert [str(kind) for kind in FaultKind] == [fault.name for fault in FAULTS]
    for fault in FAULTS:
        assert fault.description and fault.details and callable(fault.injector), fault.name
        assert fault.runs_on and fault.runs_on <= registry.EVERYWHERE_AND_NETEM, fault.name
        assert fault.aim in ("worker", "redis", "run"), fault.name
    assert set(registry.INJECTORS) == set(registry.DESCRIPTIONS) == set(FaultKind)


def test_topologies_take_the_kinds_declared_for_them_and_proxy_faults_need_one_server():
    single, cluster, sentinel = (
        kinds_on(topology.place) for topology in (SingleRedis, ClusterRedis, SentinelRedis)
    )
    assert single == kinds_on(registry.SINGLE) == registry.SINGLE_SERVER_KINDS
    assert cluster == kinds_on(registry.CLUSTER)
    assert sentinel == kinds_on(registry.SENTINEL)
    assert FaultKind.MASTER_KILL not in single and FaultKind.MASTER_KILL in sentinel
    assert all(kind in single and kind not in cluster for kind in registry.PROXY_KINDS)
