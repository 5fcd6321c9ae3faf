import pytest

from cluster.config import ClusterConfig, ClusterConfigError


def write(tmp_path, text):
    p = tmp_path / "cluster.yaml"
    p.write_text(text)
    return p


def test_yaml_with_defaults(tmp_path):
    cfg = ClusterConfig.from_yaml(write(tmp_path, "model: /models/llama\nreplicas: {min: 2, max: 4}\n"))
    assert cfg.model.name == "llama" and cfg.served_model_name == "llama"
    assert (cfg.replicas.min, cfg.replicas.max) == (2, 4)
    assert cfg.replicas.gpus_per_replica == 8 and cfg.replicas.tp == 8
    assert cfg.engine == "auto" and cfg.ray.address is None
    assert cfg.router.port == 50051


def test_tensor_parallel_defaults_to_gpus_and_must_divide_them():
    assert ClusterConfig.parse({"model": "m", "replicas": {"gpus_per_replica": 4}}).replicas.tp == 4
    assert ClusterConfig.parse({"model": "m", "replicas": {"tensor_parallel_size": 4}}).replicas.tp == 4
    with pytest.raises(ClusterConfigError, match=r"replicas: tensor_parallel_size \(3\) must divide gpus_per_replica \(8\)"):
        ClusterConfig.parse({"model": "m", "replicas": {"tensor_parallel_size": 3}})


@pytest.mark.parametrize("data, expected", [
    ({"model": "m", "replicas": {"min": 3, "max": 2}}, r"replicas: min \(3\) is larger than max \(2\)"),
    ({"model": "m", "replicas": {"gpus_per_replica": -1}}, r"replicas.gpus_per_replica: .*greater than or equal to 0"),
    ({"model": "m", "engine": "tpu"}, r"engine: Input should be 'auto', 'reference', 'monokernel' or 'paced'"),
    ({"model": "m", "router": {"port": 70000}}, r"router.port: .*less than or equal to 65535"),
    ({"model": "m", "autoscaling": {"scale_up_afer_s": 3}}, r"autoscaling.scale_up_afer_s: unknown setting"),
    ({}, r"model is required"),
    ({"model": "m", "engine": "monokernel", "replicas": {"gpus_per_replica": 0}}, r"needs GPUs"),
])
def test_bad_values_name_the_field(data, expected):
    with pytest.raises(ClusterConfigError, match=expected):
        ClusterConfig.parse(data)


def test_paced_engine_needs_no_model():
    assert ClusterConfig.parse({"engine": "paced"}).served_model_name == "paced"


def test_bad_files(tmp_path):
    with pytest.raises(ClusterConfigError, match="cannot read cluster config"):
        ClusterConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ClusterConfigError, match="not valid YAML"):
        ClusterConfig.from_yaml(write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(ClusterConfigError, match="expected a mapping"):
        ClusterConfig.from_yaml(write(tmp_path, "- a\n- b\n"))


def test_overrides_revalidate():
    cfg = ClusterConfig.parse({"model": "m"})
    assert cfg.with_overrides(**{"ray.address": "auto", "router.port": None}).ray.address == "auto"
    with pytest.raises(ClusterConfigError, match="replicas: min"):
        cfg.with_overrides(**{"replicas.min": 5})


def test_relative_model_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ClusterConfig.parse({"model": "ckpt/tiny"}).model == tmp_path / "ckpt" / "tiny"


def test_session_cache_sizing_reaches_the_replica_spec(tmp_path):
    cfg = ClusterConfig.from_yaml(write(tmp_path, "model: /models/llama\n"
                                                  "replicas: {session_cache_mb: 0.5, max_sessions: 3, metrics_port: 0}\n"))
    spec = cfg.replica_spec("replica-1")
    assert (spec.session_cache_mb, spec.max_sessions) == (0.5, 3)
    assert spec.session_limits() == {"session_cache_bytes": 2**19, "max_sessions": 3}
    assert (spec.replica_id, spec.model, spec.model_name) == ("replica-1", "/models/llama", "llama")
    assert spec.tensor_parallel_size == 8 and spec.extra == {"metrics_port": 0}
    default = ClusterConfig.parse({"model": "m"}).replica_spec("r")
    assert (default.session_cache_mb, default.max_sessions) == (None, None)  # not given: the engine default
    assert default.session_limits() == {"session_cache_bytes": 2**30, "max_sessions": 64}


@pytest.mark.parametrize("replicas, expected", [
    ({"max_sessions": -1}, r"replicas.max_sessions: .*greater than or equal to 0"),
    ({"max_sessions": 2.5}, r"replicas.max_sessions: .*valid integer"),
    ({"session_cache_mb": -1}, r"replicas.session_cache_mb: .*greater than or equal to 0"),
    ({"session_cache_mb": "lots"}, r"replicas.session_cache_mb: .*valid number"),
    ({"session_cache_mb": float("inf")}, r"replicas.session_cache_mb: .*finite number"),
    ({"session_cach_mb": 10}, r"replicas.session_cach_mb: unknown setting"),
])
def test_bad_session_cache_sizing_names_the_field(replicas, expected):
    with pytest.raises(ClusterConfigError, match=expected):
        ClusterConfig.parse({"model": "m", "replicas": replicas})


# ---- engine: monokernel with max_batch > 1 (the batched engine) -----------------------------------
def test_batched_monokernel_config_reaches_the_replica_spec():
    cfg = ClusterConfig.parse({"model": "m", "engine": "monokernel",
                               "replicas": {"max_batch": 4, "tensor_parallel_size": 1, "max_sessions": 0}})
    spec = cfg.replica_spec("r")
    assert (spec.engine, spec.max_batch, spec.tensor_parallel_size, spec.max_sessions) == ("monokernel", 4, 1, 0)
    sized = ClusterConfig.parse({"model": "m", "engine": "monokernel", "replicas": {
        "max_batch": 2, "tensor_parallel_size": 1, "session_cache_mb": 256, "max_sessions": 8}})  # batched sessions
    assert sized.replica_spec("r").session_limits() == {"session_cache_bytes": 2**28, "max_sessions": 8}
    one_gpu = ClusterConfig.parse({"model": "m", "engine": "monokernel",
                                   "replicas": {"max_batch": 8, "gpus_per_replica": 1}})
    assert one_gpu.replica_spec("r").tensor_parallel_size == 1
    resident = ClusterConfig.parse({"model": "m", "engine": "monokernel",
                                    "replicas": {"max_batch": 4, "tensor_parallel_size": 1, "resident": True}})
    assert resident.replica_spec("r").resident and not spec.resident
    with pytest.raises(ClusterConfigError, match="resident is for the batched monokernel: set max_batch to 2..8"):
        ClusterConfig.parse({"model": "m", "engine": "monokernel", "replicas": {"resident": True}})
    # auto may pick the reference engine (any max_batch); the actor falls back on a GPU (see make_engine)
    assert ClusterConfig.parse({"model": "m", "replicas": {"max_batch": 16}}).replicas.max_batch == 16


@pytest.mark.parametrize("replicas, expected", [
    ({"max_batch": 9, "tensor_parallel_size": 1},
     "config: engine 'monokernel': replicas.max_batch 9: the monokernel decodes at most 8 sequences together on "
     "one GPU (the kernel's limit, replicas.layout.MAX_BATCH); use replicas.max_batch 2..8"),
    ({"max_batch": 4},
     "config: engine 'monokernel': replicas.max_batch 4 with replicas.tensor_parallel_size 8 (the default: "
     "replicas.gpus_per_replica): tensor parallelism and batching are not supported together (the "
     "tensor-parallel monokernel decodes one sequence at a time); set replicas.tensor_parallel_size to 1 (one "
     "batched engine per GPU: a replica with N GPUs serves N x max_batch), or keep replicas.max_batch 1"),
    ({"max_batch": 2, "tensor_parallel_size": 2}, "replicas.max_batch 2 with replicas.tensor_parallel_size 2: "),
])
def test_batched_monokernel_refusals_name_the_fields(replicas, expected):
    with pytest.raises(ClusterConfigError) as e:
        ClusterConfig.parse({"model": "m", "engine": "monokernel", "replicas": replicas})
    assert expected in str(e.value)


def test_batched_monokernel_is_checked_again_after_overrides_and_a_json_round_trip():
    batched = {"model": "m", "replicas": {"max_batch": 4, "tensor_parallel_size": 1}}
    cfg = ClusterConfig.parse(batched).with_overrides(engine="monokernel")  # `monoserve up --engine monokernel`
    assert ClusterConfig.model_validate_json(cfg.model_dump_json()) == cfg  # as the supervisor actor reads it
    with pytest.raises(ClusterConfigError, match="replicas.max_batch 4 with replicas.tensor_parallel_size 2"):
        ClusterConfig.parse({**batched, "replicas": {**batched["replicas"], "tensor_parallel_size": 2}}
                            ).with_overrides(engine="monokernel")
