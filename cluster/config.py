"""Cluster configuration: what `monoserve up` starts, read from YAML.

Example (every field optional except `model`, unless `engine: paced`):

    model: /models/Llama-3.2-1B-Instruct
    engine: auto            # auto | reference | monokernel | paced
    replicas: {min: 2, max: 4, gpus_per_replica: 8, cpus_per_replica: 1,
               session_cache_mb: 1024, max_sessions: 64}   # agent-session KV kept between turns
    # engine: monokernel with replicas.max_batch 2..8 = one batched engine per GPU; it needs
    # tensor_parallel_size: 1 (the session settings size each engine's session KV cache)
    router: {host: 0.0.0.0, port: 50051, http_port: 8000, metrics_port: 9090}
    autoscaling: {scale_up_after_s: 5, scale_down_idle_s: 60}
    ray: {address: auto}    # or null: start a local Ray with `num_gpus` logical GPUs
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

EngineKind = Literal["auto", "reference", "monokernel", "paced"]


class ClusterConfigError(ValueError):
    """The cluster configuration is invalid; the message names the field and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaSettings(_Section):
    min: int = Field(1, ge=0, description="Replicas kept running even when idle.")
    max: int = Field(1, ge=1, description="Most replicas autoscaling may start.")
    gpus_per_replica: int = Field(8, ge=0, description="GPUs one replica owns (one 8-GPU node by default).")
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="GPUs one engine spans; defaults to gpus_per_replica and must divide it.")
    cpus_per_replica: float = Field(1.0, gt=0, description="CPUs reserved in each replica's placement group.")
    max_batch: int = Field(
        1, ge=1, description="Concurrent generations per engine (slots); monokernel: 2..8 = the batched engine.")
    resident: bool = Field(
        False, description="Batched monokernel (max_batch 2..8): requests join a running batch launch without a "
                           "relaunch; its batch builds leave SMs to the joiners' prefill.")
    paced_tokens_per_s: float = Field(200.0, gt=0, description="Token rate of the `paced` test engine.")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus port of each replica (one per node); 0 = any; null = off.")
    # None = the engine default
    session_cache_mb: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="MiB of agent-session KV each engine keeps between turns (engines with session reuse); "
                    "default 1024.")
    max_sessions: int | None = Field(
        None, ge=0, description="Agent sessions each engine keeps between turns, LRU; 0 = no reuse; default 64.")

    @model_validator(mode="after")
    def _check(self) -> ReplicaSettings:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max}): set min <= max")
        if self.resident and self.max_batch < 2:
            raise ValueError("resident is for the batched monokernel: set max_batch to 2..8 or drop resident")
        tp = self.tensor_parallel_size
        if tp is not None:
            if self.gpus_per_replica == 0:
                raise ValueError("tensor_parallel_size needs GPUs: set gpus_per_replica >= 1 or drop it")
            if self.gpus_per_replica % tp:
                raise ValueError(
                    f"tensor_parallel_size ({tp}) must divide gpus_per_replica ({self.gpus_per_replica})")
        return self

    @property
    def tp(self) -> int:
        """Effective tensor-parallel size (at least 1, also for CPU-only replicas)."""
        return self.tensor_parallel_size or max(self.gpus_per_replica, 1)


class RouterSettings(_Section):
    host: str = Field("0.0.0.0", description="Interface the router's gRPC/HTTP servers bind.")
    port: int = Field(50051, ge=0, le=65535, description="Client gRPC port; 0 = any free port.")
    http_port: int | None = Field(None, ge=0, le=65535, description="OpenAI-compatible HTTP port; null = off.")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus port; null = off.")
    queue_size: int = Field(64, ge=1, description="Requests that may wait in the router queue.")
    cpus: float = Field(1.0, gt=0, description="CPUs reserved for the router actor.")


class AutoscalingSettings(_Section):
    enabled: bool = True
    scale_up_after_s: float = Field(5.0, ge=0, description="Add a replica once the router queue stayed non-empty this long.")
    scale_down_idle_s: float = Field(60.0, ge=0, description="Remove a replica once it stayed idle this long (down to min).")
    interval_s: float = Field(1.0, gt=0, description="Seconds between supervision rounds.")
    health_timeout_s: float = Field(10.0, gt=0, description="A replica not answering health this long is replaced.")
    start_timeout_s: float = Field(600.0, gt=0, description="A replica not ready after this long is replaced.")


class RaySettings(_Section):
    address: str | None = Field(None, description="Ray cluster to join ('auto', 'ray://host:10001'); null = start a local one.")
    num_gpus: int | None = Field(
        None, ge=0, description="Logical GPUs of a local cluster (CPU-only machines); null = detect.")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local cluster; null = detect.")
    namespace: str = Field("monoserve", min_length=1, description="Ray namespace of monoserve's named actors.")


class ClusterConfig(_Section):
    model: Path | None = Field(None, description="Checkpoint directory (Hugging Face layout), same path on every node.")
    model_name: str | None = Field(None, description="Name clients use; defaults to the directory name.")
    engine: EngineKind = "auto"
    replicas: ReplicaSettings = ReplicaSettings()
    router: RouterSettings = RouterSettings()
    autoscaling: AutoscalingSettings = AutoscalingSettings()
    ray: RaySettings = RaySettings()

    @field_validator("model")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        # replicas run in other processes/nodes: a relative path means relative to where `up` runs
        return None if v is None else (Path.cwd() / v.expanduser()).absolute()

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.model is None and self.engine != "paced":
            raise ValueError("model is required: give the checkpoint directory (model: /path/to/checkpoint)")
        if self.engine == "monokernel" and self.replicas.gpus_per_replica == 0:
            raise ValueError("engine 'monokernel' needs GPUs: set replicas.gpus_per_replica >= 1")
        from replicas.monokernel_choice import fields_problem

        rs = self.replicas
        problem = fields_problem(self.engine, rs.max_batch, rs.tp, prefix="replicas.",
                                 tp_given=rs.tensor_parallel_size is not None)
        if problem:
            raise ValueError(problem)
        return self

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        return self.model.name if self.model is not None else "paced"

    def replica_spec(self, replica_id: str):
        """The `replicas.actor.ReplicaSpec` of one replica of this cluster."""
        from replicas.actor import ReplicaSpec

        rs = self.replicas
        return ReplicaSpec(replica_id=replica_id, model=str(self.model) if self.model else None, engine=self.engine,
                           model_name=self.served_model_name, tensor_parallel_size=rs.tp,
                           max_batch=rs.max_batch, resident=rs.resident, paced_tokens_per_s=rs.paced_tokens_per_s,
                           session_cache_mb=rs.session_cache_mb, max_sessions=rs.max_sessions,
                           extra={"metrics_port": rs.metrics_port} if rs.metrics_port is not None else {})

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def parse(cls, data: dict | None, source: str = "config") -> ClusterConfig:
        """Validate a mapping; errors become ClusterConfigError naming each bad field."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ClusterConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ClusterConfigError(f"{source}: invalid cluster config: " + _describe(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ClusterConfigError(f"cannot read cluster config {path}: {e.strerror or e}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ClusterConfigError(f"{path}: not valid YAML: {e}") from None
        return cls.parse(data, source=str(path))

    def with_overrides(self, **dotted) -> ClusterConfig:
        """A copy with `section.field=value` overrides (None values are ignored), re-validated."""
        data = self.model_dump(mode="json")
        for key, value in dotted.items():
            if value is None:
                continue
            *sections, name = key.split(".")
            node = data
            for s in sections:
                node = node.setdefault(s, {})
            node[name] = value
        return self.parse(data, source="config with overrides")


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting (check the spelling; see cluster/config.py for the fields)"
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)
