"""Ray Serve application: `monoserve.v1.Inference` over Serve's gRPC proxy, engine replicas in
8-GPU STRICT_PACK placement groups, routed by monoserve's latency-aware request router.

    serve run deploy/serve.yaml                                   # the config file
    serve run deploy.serve_app:build_app model=/models/Llama-3.2-1B-Instruct num_replicas=2
    MONOSERVE_MODEL=/models/x serve run deploy.serve_app:app      # `app` reads MONOSERVE_* env

Serve's gRPC proxy must list our servicer (serve.yaml `grpc_options`, or
`serve.start(grpc_options=gRPCOptions(grpc_servicer_functions=[GRPC_SERVICER]))`).
"""

from __future__ import annotations

import os
from dataclasses import asdict

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from ray.serve.config import RequestRouterConfig

from cluster.config import EngineKind
from deploy.serve_ingress import InferenceIngress
from deploy.serve_replica import EngineReplica
from deploy.serve_router import LatencyAwareRequestRouter
from replicas.actor import ReplicaSpec, placement_bundle

GRPC_SERVICER = "monoserve.v1.inference_pb2_grpc.add_InferenceServicer_to_server"
APP_NAME = "monoserve"


class ServeAppArgs(BaseModel):
    """Arguments of `build_app` (serve.yaml `args`, or `key=value` after `serve run`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Checkpoint directory, same path on every node.")
    model_name: str | None = None
    engine: EngineKind = "auto"
    num_replicas: int = Field(1, ge=1, description="Engine replicas (one GPU node each by default).")
    gpus_per_replica: int = Field(8, ge=0)
    cpus_per_replica: float = Field(1.0, gt=0)
    tensor_parallel_size: int | None = Field(None, ge=1)
    max_batch: int = Field(1, ge=1, description="Engine slots = Serve max_ongoing_requests per replica; "
                                                "monokernel: 2..8 = the batched engine.")
    resident: bool = Field(False, description="Batched monokernel: requests join a running batch launch "
                                              "without a relaunch (needs max_batch 2..8).")
    paced_tokens_per_s: float = Field(200.0, gt=0)
    # None = the engine default
    session_cache_mb: float | None = Field(None, ge=0, allow_inf_nan=False,
                                           description="MiB of agent-session KV each engine keeps between turns "
                                                       "(default 1024).")
    max_sessions: int | None = Field(None, ge=0, description="Agent sessions each engine keeps between turns; "
                                                             "0 = no reuse (default 64).")
    ingress_replicas: int = Field(1, ge=1)
    ingress_cpus: float = Field(1.0, gt=0)
    routing_stats_period_s: float = Field(1.0, gt=0, description="How often replicas report load to the router.")

    @model_validator(mode="after")
    def _check(self) -> ServeAppArgs:
        if self.model is None and self.engine != "paced":
            raise ValueError("model is required: pass model=/path/to/checkpoint")
        tp = self.tensor_parallel_size
        if tp is not None and (self.gpus_per_replica == 0 or self.gpus_per_replica % tp):
            raise ValueError(f"tensor_parallel_size ({tp}) must divide gpus_per_replica ({self.gpus_per_replica})")
        from replicas.monokernel_choice import fields_problem

        problem = fields_problem(self.engine, self.max_batch, self.tp, tp_given=tp is not None)
        if problem:
            raise ValueError(problem)
        if self.resident and self.max_batch < 2:
            raise ValueError("resident is for the batched monokernel: set max_batch to 2..8 or drop resident")
        return self

    @property
    def tp(self) -> int:
        """Effective tensor-parallel size: defaults to all of a replica's GPUs (at least 1)."""
        return self.tensor_parallel_size or max(self.gpus_per_replica, 1)

    @property
    def slots(self) -> int:
        """Concurrent generations per replica: one engine per tensor-parallel GPU group on GPU
        nodes (the reference engine on CPU is a single engine and queues the excess)."""
        groups = self.gpus_per_replica // (self.tensor_parallel_size or self.gpus_per_replica) \
            if self.gpus_per_replica and self.engine in ("auto", "monokernel") else 1
        return self.max_batch * groups

    @property
    def served_name(self) -> str:
        if self.model_name:
            return self.model_name
        return os.path.basename(os.path.normpath(self.model)) if self.model else "paced"


def build_app(args: dict | None = None):
    """The Serve application (ingress bound to the engine deployment)."""
    try:
        a = ServeAppArgs.model_validate(args or {})
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'args'}: {err['msg'].removeprefix('Value error, ')}"
                             for err in e.errors())
        raise ValueError(f"invalid monoserve Serve app arguments: {problems}") from None
    spec = ReplicaSpec(replica_id="serve", model=a.model, engine=a.engine, model_name=a.served_name,
                       tensor_parallel_size=a.tp,
                       max_batch=a.max_batch, resident=a.resident, paced_tokens_per_s=a.paced_tokens_per_s,
                       session_cache_mb=a.session_cache_mb, max_sessions=a.max_sessions)
    bundle = placement_bundle(a.gpus_per_replica, a.cpus_per_replica)
    replica = EngineReplica.options(
        num_replicas=a.num_replicas,
        max_ongoing_requests=a.slots,
        ray_actor_options={"num_cpus": a.cpus_per_replica, "num_gpus": a.gpus_per_replica},
        placement_group_bundles=[bundle],  # one bundle: the replica's whole node
        placement_group_strategy="STRICT_PACK",
        request_router_config=RequestRouterConfig(request_router_class=LatencyAwareRequestRouter,
                                                  request_routing_stats_period_s=a.routing_stats_period_s),
    )
    ingress = InferenceIngress.options(num_replicas=a.ingress_replicas, max_ongoing_requests=1000,
                                       ray_actor_options={"num_cpus": a.ingress_cpus})
    engine_kind = a.engine if a.engine != "auto" else "auto (monokernel on GPU nodes, reference otherwise)"
    return ingress.bind(replica.bind(asdict(spec)), a.model, a.served_name, engine_kind)


def _args_from_env() -> dict:
    """MONOSERVE_MODEL, MONOSERVE_ENGINE, MONOSERVE_NUM_REPLICAS, MONOSERVE_GPUS_PER_REPLICA, ..."""
    out = {}
    for name in ServeAppArgs.model_fields:
        value = os.environ.get(f"MONOSERVE_{name.upper()}")
        if value is not None:
            out[name] = value
    return out


def __getattr__(name: str):
    # `serve run deploy.serve_app:app` builds from the environment at import time of `app` only,
    # so importing this module (tests, other tools) needs no configuration.
    if name == "app":
        return build_app(_args_from_env())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
