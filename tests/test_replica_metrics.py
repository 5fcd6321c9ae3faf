"""The replica's Prometheus registry: the batched monokernel's launch / join counters and join mode."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

from replicas.metrics import ReplicaMetrics


def test_a_resident_engines_launches_joins_and_join_mode_are_read_at_scrape():
    engine = SimpleNamespace(launches=3, resident_joins=0, resident=True, _joiner=SimpleNamespace(mode="fp32"))
    reg = ReplicaMetrics("r0", 4, engine=engine).registry
    assert reg.get_sample_value("monoserve_replica_kernel_launches_total") == 3
    engine.launches, engine.resident_joins, engine.stalled_joins = 5, 7, 1  # read live, not copied at construction
    assert reg.get_sample_value("monoserve_replica_kernel_launches_total") == 5
    assert reg.get_sample_value("monoserve_replica_resident_joins_total") == 7
    assert reg.get_sample_value("monoserve_replica_stalled_joins_total") == 1
    assert reg.get_sample_value("monoserve_replica_join_mode", {"mode": "fp32"}) == 1
    engine._joiner = None  # nothing ran beside a launch: joins are off
    assert reg.get_sample_value("monoserve_replica_join_mode", {"mode": "off"}) == 1
    assert b"monoserve_replica_resident_joins_total 7.0" in generate_latest(reg)


def test_engines_without_launch_counters_export_none_and_plain_batched_no_join_mode():
    reg = ReplicaMetrics("r1", 1, engine=SimpleNamespace()).registry  # e.g. the reference engine
    assert reg.get_sample_value("monoserve_replica_kernel_launches_total") is None
    reg = ReplicaMetrics("r2", 4, engine=SimpleNamespace(launches=2, resident_joins=0, resident=False)).registry
    assert reg.get_sample_value("monoserve_replica_kernel_launches_total") == 2
    assert b"monoserve_replica_join_mode" not in generate_latest(reg)
