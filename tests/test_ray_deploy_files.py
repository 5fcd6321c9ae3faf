"""The shipped deployment files parse and carry arguments our code accepts."""

import warnings
from pathlib import Path

import pytest
import yaml

from cluster.config import ClusterConfig

with warnings.catch_warnings():  # Ray Serve's own pydantic models warn on import; not ours to fix
    warnings.simplefilter("ignore", DeprecationWarning)
    from ray.serve.schema import ServeDeploySchema

    from deploy.serve_app import GRPC_SERVICER, ServeAppArgs, build_app

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def serve_configs():
    yield "serve.yaml", yaml.safe_load((DEPLOY / "serve.yaml").read_text())
    manifest = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    yield "kuberay-rayservice.yaml", yaml.safe_load(manifest["spec"]["serveConfigV2"])


@pytest.mark.parametrize("name, config", list(serve_configs()))
def test_serve_configs_use_our_app_and_grpc_servicer(name, config):
    ServeDeploySchema.model_validate(config)  # what `serve run` / `serve deploy` / KubeRay check
    assert config["grpc_options"]["grpc_servicer_functions"] == [GRPC_SERVICER]
    (app,) = config["applications"]
    assert app["import_path"] == "deploy.serve_app:build_app"
    args = ServeAppArgs.model_validate(app["args"])
    assert args.gpus_per_replica == 8
    assert args.slots == 8 * args.max_batch // args.tensor_parallel_size  # one engine per GPU group


def test_kuberay_workers_are_whole_8_gpu_nodes():
    manifest = yaml.safe_load((DEPLOY / "kuberay-rayservice.yaml").read_text())
    (group,) = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"


def test_cluster_launcher_yaml_is_valid_and_has_8_gpu_worker_nodes():
    import json

    import jsonschema
    import ray

    cfg = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(cfg, schema)  # the schema `ray up` validates against
    workers = [t for name, t in cfg["available_node_types"].items() if name != cfg["head_node_type"]]
    assert workers and all(t["resources"]["GPU"] == 8 for t in workers)


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-local.yaml"])
def test_cluster_configs_validate(name):
    cfg = ClusterConfig.from_yaml(DEPLOY / name)
    assert cfg.replicas.gpus_per_replica == 8


def test_serve_slots_follow_engine_groups():
    assert ServeAppArgs(model="/m", tensor_parallel_size=2, max_batch=2).slots == 8  # 4 engines x 2
    assert ServeAppArgs(model="/m").slots == 1  # tp defaults to all 8 GPUs: one engine
    assert ServeAppArgs(model="/m", engine="reference", tensor_parallel_size=1).slots == 1  # CPU: one engine


def test_build_app_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="num_replicas: Input should be greater than or equal to 1"):
        build_app({"model": "/m", "num_replicas": 0})
    with pytest.raises(ValueError, match="model is required"):
        build_app({})
    with pytest.raises(ValueError, match="tensor_parallel_size \\(3\\) must divide gpus_per_replica \\(8\\)"):
        build_app({"model": "/m", "tensor_parallel_size": 3})
    with pytest.raises(ValueError, match="gpu_per_replica: Extra inputs are not permitted"):
        build_app({"model": "/m", "gpu_per_replica": 8})


def test_serve_app_session_cache_sizing_is_validated_by_name():
    assert (ServeAppArgs(model="/m", session_cache_mb=0.5, max_sessions=3).max_sessions) == 3
    with pytest.raises(ValueError, match="max_sessions: Input should be greater than or equal to 0"):
        build_app({"model": "/m", "max_sessions": -1})
    with pytest.raises(ValueError, match="session_cache_mb: Input should be a finite number"):
        build_app({"model": "/m", "session_cache_mb": float("nan")})


def test_serve_app_refuses_what_the_monokernel_cannot_batch():
    assert ServeAppArgs(model="/m", engine="monokernel", max_batch=4, tensor_parallel_size=1).slots == 32  # 8 x 4
    with pytest.raises(ValueError, match=r"engine 'monokernel': max_batch 4 with tensor_parallel_size 8 \(the "
                                         r"default: gpus_per_replica\): tensor parallelism and batching"):
        build_app({"model": "/m", "engine": "monokernel", "max_batch": 4})
    with pytest.raises(ValueError, match="max_batch 9: the monokernel decodes at most 8 sequences"):
        build_app({"model": "/m", "engine": "monokernel", "max_batch": 9, "tensor_parallel_size": 1})
    assert ServeAppArgs(model="/m", engine="monokernel", max_batch=2, tensor_parallel_size=1, resident=True).resident
    with pytest.raises(ValueError, match="resident is for the batched monokernel: set max_batch to 2..8"):
        build_app({"model": "/m", "engine": "monokernel", "resident": True, "tensor_parallel_size": 1})
    # the batched engine keeps sessions' KV: the session settings are accepted with max_batch > 1
    args = ServeAppArgs(model="/m", engine="monokernel", max_batch=2, tensor_parallel_size=1, max_sessions=3)
    assert (args.slots, args.max_sessions) == (16, 3)
