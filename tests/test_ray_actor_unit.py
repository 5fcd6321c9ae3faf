"""Replica actor pieces that need no Ray cluster: spec checks, bundles, engine choice."""

import re

import pytest

from replicas.actor import (
    ReplicaSpec,
    make_engine,
    placement_bundle,
    resolve_engine_kind,
)


def test_bundle_is_one_node_worth_of_gpus_and_leaves_out_zero_amounts():
    assert placement_bundle(8, 1) == {"CPU": 1.0, "GPU": 8.0}
    assert placement_bundle(0, 0.5) == {"CPU": 0.5}


def test_auto_engine_is_reference_without_cuda():
    assert resolve_engine_kind("auto", 8) == "reference"  # logical GPUs on a CPU machine
    assert resolve_engine_kind("auto", 0) == "reference"
    assert resolve_engine_kind("paced", 8) == "paced"


def test_spec_rejects_unknown_engine_and_missing_model():
    with pytest.raises(ValueError, match="engine must be one of auto, reference, monokernel, paced"):
        ReplicaSpec(replica_id="r", model="/m", engine="tpu")
    with pytest.raises(ValueError, match="model directory is required for engine 'reference'"):
        ReplicaSpec(replica_id="r", model=None, engine="reference")


def test_monokernel_without_gpus_is_a_clear_error(tiny_checkpoint):
    with pytest.raises(RuntimeError, match="needs GPUs but Ray granted none"):
        make_engine(ReplicaSpec(replica_id="r", model=str(tiny_checkpoint), engine="monokernel"), devices=[])


def test_makes_reference_and_paced_engines(tiny_checkpoint):
    ref = make_engine(ReplicaSpec(replica_id="r", model=str(tiny_checkpoint), engine="auto", max_batch=2), [0, 1])
    assert ref.kind == "reference" and ref.max_batch == 2
    paced = make_engine(ReplicaSpec(replica_id="r", model=str(tiny_checkpoint), engine="paced"), [])
    assert paced.kind == "paced" and paced.config.vocab_size == ref.config.vocab_size


def test_session_cache_sizing_reaches_the_reference_engine_and_is_ignored_by_others(tiny_checkpoint):
    spec = ReplicaSpec(replica_id="r", model=str(tiny_checkpoint), engine="reference", session_cache_mb=0.5,
                       max_sessions=3)
    stats = make_engine(spec, []).session_stats()
    assert (stats.max_bytes, stats.max_sessions) == (2**19, 3)
    off = make_engine(ReplicaSpec(replica_id="r", model=str(tiny_checkpoint), engine="reference", max_sessions=0), [])
    assert off.session_stats().max_sessions == 0
    paced = make_engine(ReplicaSpec(replica_id="r", model=None, engine="paced", max_sessions=3), [])
    assert paced.kind == "paced"  # no session cache: the sizing is ignored, not an error


def test_engine_factories_get_only_the_session_settings_they_take():
    from replicas.actor import supported_kwargs

    limits = {"session_cache_bytes": 1, "max_sessions": 2}
    assert supported_kwargs(lambda path, devices=(0,): None, limits) == {}  # e.g. today's monokernel
    assert supported_kwargs(lambda path, max_sessions=64: None, limits) == {"max_sessions": 2}
    assert supported_kwargs(lambda path, **kw: None, limits) == limits


@pytest.mark.parametrize("field, value, expected", [
    ("max_sessions", -1, "max_sessions must be an integer >= 0"),
    ("max_sessions", 1.5, "max_sessions must be an integer >= 0"),
    ("session_cache_mb", -0.5, "session_cache_mb must be a number of MiB >= 0"),
    ("session_cache_mb", float("nan"), "session_cache_mb must be a number of MiB >= 0"),
    ("session_cache_mb", "1G", "session_cache_mb must be a number of MiB >= 0"),
])
def test_spec_rejects_bad_session_cache_sizing_naming_the_field(field, value, expected):
    with pytest.raises(ValueError, match=f"replica r: {expected}"):
        ReplicaSpec(replica_id="r", model="/m", engine="reference", **{field: value})


# ---- the monokernel's max_batch (fixtures `monokernel_builds`, `fake_cupy`: tests/conftest.py) ------
def test_monokernel_max_batch_builds_one_batched_engine_per_gpu(monokernel_builds):
    from replicas.engine_group import EngineGroup

    engine = make_engine(ReplicaSpec(replica_id="r", model="/m", engine="monokernel", max_batch=4), [0, 1])
    assert isinstance(engine, EngineGroup) and engine.max_batch == 8  # 2 GPUs x 4 slots
    assert sorted(kw["devices"] for _, kw in monokernel_builds) == [[0], [1]]
    assert {name for name, _ in monokernel_builds} == {"BatchedMonokernelEngine"}
    assert all(kw == {"batch": 4, "devices": kw["devices"], "resident": False, "session_cache_bytes": 2**30,
                      "max_sessions": 64} for _, kw in monokernel_builds)
    make_engine(ReplicaSpec(replica_id="r", model="/m", engine="monokernel", max_batch=2, max_sessions=8,
                            session_cache_mb=0.5, resident=True), [0])  # each batched engine keeps sessions' KV
    assert monokernel_builds[-1] == ("BatchedMonokernelEngine", {"batch": 2, "devices": [0], "resident": True,
                                                                 "session_cache_bytes": 2**19, "max_sessions": 8})
    with pytest.raises(ValueError, match="resident is for the batched monokernel; set max_batch to 2..8"):
        ReplicaSpec(replica_id="r", model="/m", engine="monokernel", resident=True)


def test_monokernel_max_batch_one_keeps_the_single_sequence_engine_and_its_sessions(monokernel_builds):
    make_engine(ReplicaSpec(replica_id="r", model="/m", engine="monokernel", tensor_parallel_size=2,
                            max_sessions=3), [0, 1])
    assert monokernel_builds == [("MonokernelEngine", {"devices": [0, 1], "session_cache_bytes": 2**30,
                                                       "max_sessions": 3})]


def test_auto_on_a_gpu_follows_max_batch_and_falls_back_when_the_monokernel_cannot_batch(monokernel_builds,
                                                                                      caplog):
    assert resolve_engine_kind("auto", 1) == "monokernel"  # the stand-in CuPy sees a GPU
    make_engine(ReplicaSpec(replica_id="r", model="/m", engine="auto", max_batch=2), [0])
    # auto's max_batch may have been meant for the reference engine: not an error, a warning + one sequence
    with caplog.at_level("WARNING", logger="monoserve.replica"):
        make_engine(ReplicaSpec(replica_id="r", model="/m", engine="auto", max_batch=16), [0])
    assert [name for name, _ in monokernel_builds] == ["BatchedMonokernelEngine", "MonokernelEngine"]
    assert "engine auto chose the monokernel, which cannot serve this: engine 'monokernel': max_batch 16" \
        in caplog.text and "serving one sequence per engine" in caplog.text


@pytest.mark.parametrize("fields, expected", [
    (dict(max_batch=9), "engine 'monokernel': max_batch 9: the monokernel decodes at most 8 sequences together "
                        "on one GPU"),
    (dict(max_batch=4, tensor_parallel_size=8),
     "engine 'monokernel': max_batch 4 with tensor_parallel_size 8: tensor parallelism and batching are not "
     "supported together (the tensor-parallel monokernel decodes one sequence at a time); set "
     "tensor_parallel_size to 1 (one batched engine per GPU: a replica with N GPUs serves N x max_batch), "
     "or keep max_batch 1"),
    (dict(max_batch=0), "max_batch must be an integer >= 1, got 0"),
])
def test_spec_refuses_what_the_monokernel_cannot_batch(fields, expected):
    with pytest.raises(ValueError, match="^replica r: .*" + re.escape(expected)):
        ReplicaSpec(replica_id="r", model="/m", engine="monokernel", **fields)


def test_spec_batch_limits_are_the_monokernels_only():
    ReplicaSpec(replica_id="r", model="/m", engine="reference", max_batch=16, max_sessions=8)
    ReplicaSpec(replica_id="r", model="/m", engine="auto", max_batch=16, tensor_parallel_size=8)
    ReplicaSpec(replica_id="r", model="/m", engine="monokernel", max_batch=8, max_sessions=0)  # 0 = no reuse
    ReplicaSpec(replica_id="r", model="/m", engine="monokernel", max_batch=8, max_sessions=8, session_cache_mb=256)


def test_ray_tests_are_grouped_onto_one_xdist_worker(request):
    """`make test` runs two workers; two local Ray clusters starting at once on CI's two cores time out
    (tests/conftest.py). The group is only honoured if xdist saw the marker when it named the items."""
    assert request.node.get_closest_marker("xdist_group").args == ("ray",)
    if getattr(request.config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        assert request.node.nodeid.endswith("@ray")
