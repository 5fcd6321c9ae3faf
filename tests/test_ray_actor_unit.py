"""Replica actor pieces that need no Ray cluster: spec checks, bundles, engine choice."""

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
