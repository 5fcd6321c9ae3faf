"""`ReplicaActor`: one replica as a Ray actor that owns a node's GPUs.

The actor is scheduled into a `STRICT_PACK` placement group of one bundle
`{GPU: gpus_per_replica, CPU: n}` (see `placement_bundle`), so all its GPUs are on one node.
Ray sets CUDA_VISIBLE_DEVICES to exactly the GPUs it granted (`ray.get_gpu_ids()`); inside the
process they are ordinals 0..n-1, which become the engine's devices. The actor starts the
engine (monokernel where CUDA + CuPy are present and the kind is `auto`, the numpy reference
engine otherwise) and a `ReplicaServer` bound to the node's IP, then answers
ready/health/drain/stop/info. The router talks to the replica over gRPC, never through Ray.
On the monokernel, max_batch 2..8 means one batched engine per GPU (tensor_parallel_size 1;
replicas/monokernel_choice.py says which settings it refuses).

The class is plain Python; `remote_class()` wraps it with `ray.remote` (threaded, so health
answers while a drain waits).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field

log = logging.getLogger("monoserve.replica")

ENGINE_KINDS = ("auto", "reference", "monokernel", "paced")


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything a replica actor needs to start (plain data: crosses Ray process boundaries)."""

    replica_id: str
    model: str | None  # checkpoint directory on the node (None only for the paced engine)
    engine: str = "auto"
    model_name: str | None = None
    tensor_parallel_size: int = 1
    max_batch: int = 1  # monokernel: 2..8 = the batched engine (one per GPU: tensor_parallel_size 1)
    resident: bool = False  # batched monokernel: requests join a running launch (replicas/monokernel_resident.py)
    paced_tokens_per_s: float = 200.0
    # agent-session KV kept between turns (engines that support sessions; ignored by the others).
    # None = the default (1024 MiB, 64 sessions)
    session_cache_mb: float | None = None
    max_sessions: int | None = None  # 0 = no reuse
    host: str | None = None  # bind address; None = the node's IP as Ray sees it
    port: int = 0
    extra: dict = field(default_factory=dict)  # forwarded to ReplicaServer (e.g. metrics_port)

    def __post_init__(self):
        if self.engine not in ENGINE_KINDS:
            raise ValueError(f"engine must be one of {', '.join(ENGINE_KINDS)}, got {self.engine!r}")
        if self.model is None and self.engine != "paced":
            raise ValueError(f"replica {self.replica_id}: model directory is required for engine {self.engine!r}")
        mb, n = self.session_cache_mb, self.max_sessions
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not math.isfinite(mb)
                               or mb < 0):
            raise ValueError(f"replica {self.replica_id}: session_cache_mb must be a number of MiB >= 0, got {mb!r}")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"replica {self.replica_id}: max_sessions must be an integer >= 0 "
                             f"(0 turns session reuse off), got {n!r}")
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"replica {self.replica_id}: max_batch must be an integer >= 1, got {self.max_batch!r}")
        if self.resident and self.max_batch < 2:
            raise ValueError(f"replica {self.replica_id}: resident is for the batched monokernel; set max_batch "
                             "to 2..8 or drop resident")
        problem = self.batch_problem(self.engine)  # `auto`: judged once it picked (monokernel_loader)
        if problem:
            raise ValueError(f"replica {self.replica_id}: {problem}")

    def session_limits(self) -> dict[str, int]:
        """The session-cache keywords of `ReferenceEngine.from_pretrained` (and of any engine
        factory that takes the same names)."""
        from replicas.session_cache import session_limits

        return session_limits(self.session_cache_mb, self.max_sessions)

    def batch_problem(self, engine: str) -> str | None:
        """Why `engine` cannot serve this spec's max_batch (None when it can; only the monokernel refuses)."""
        from replicas.monokernel_choice import fields_problem

        return fields_problem(engine, self.max_batch, self.tensor_parallel_size)


def placement_bundle(gpus: int, cpus: float) -> dict[str, float]:
    """The single placement-group bundle of one replica (zero amounts left out, Ray rejects them)."""
    bundle = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def cuda_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 -- no driver, no device, broken install: all mean "use the CPU engine"
        return False


def resolve_engine_kind(kind: str, num_gpus: int) -> str:
    """`auto` = the monokernel where it can run (GPUs granted, CUDA + CuPy, module present)."""
    if kind == "auto":
        usable = (num_gpus > 0 and importlib.util.find_spec("replicas.monokernel") is not None
                  and cuda_available())
        if num_gpus > 0 and not usable:
            log.warning("engine auto: %d GPUs granted but the monokernel cannot run here "
                        "(no CUDA device, CuPy or replicas.monokernel); using the reference engine", num_gpus)
        return "monokernel" if usable else "reference"
    return kind


def make_engine(spec: ReplicaSpec, devices: list[int]):
    """Build the engine the spec asks for on these local device ordinals."""
    kind = resolve_engine_kind(spec.engine, len(devices))
    if kind == "reference":
        from replicas.reference import ReferenceEngine

        return ReferenceEngine.from_pretrained(spec.model, max_batch=spec.max_batch, **spec.session_limits())
    if kind == "monokernel":
        if not devices:
            raise RuntimeError(f"replica {spec.replica_id}: engine 'monokernel' needs GPUs but Ray granted none")
        return engines_per_gpu_group(monokernel_loader(spec), devices, spec.tensor_parallel_size)
    from replicas.model import ModelConfig
    from replicas.testing import PacedEngine, tiny_config

    config = ModelConfig.from_pretrained(spec.model) if spec.model else tiny_config()
    return PacedEngine(config, tokens_per_s=spec.paced_tokens_per_s, max_batch=spec.max_batch)


def monokernel_loader(spec: ReplicaSpec):
    """`load(gpu_group) -> engine` for the monokernel: batched for max_batch 2..8, else single-sequence."""
    batch = spec.max_batch
    problem = spec.batch_problem("monokernel")
    if problem:  # only `auto` gets here (the spec refuses it for `monokernel`): max_batch was meant for
        # whichever engine auto picks, so keep the single-sequence monokernel rather than fail the node
        log.warning("replica %s: engine auto chose the monokernel, which cannot serve this: %s; "
                    "serving one sequence per engine", spec.replica_id, problem)
        batch = 1
    if batch > 1:
        from replicas.monokernel_batched import BatchedMonokernelEngine

        limits = spec.session_limits()  # sessions' KV kept per engine, as on the single-sequence one
        return lambda group: BatchedMonokernelEngine.from_pretrained(spec.model, batch=batch, devices=group,
                                                                     resident=spec.resident, **limits)
    from replicas.monokernel import MonokernelEngine

    limits = supported_kwargs(MonokernelEngine.from_pretrained, spec.session_limits())
    return lambda group: MonokernelEngine.from_pretrained(spec.model, devices=group, **limits)


def supported_kwargs(factory, kwargs: dict) -> dict:
    """The subset of `kwargs` that `factory` takes (engines without session reuse take none of the
    session-cache settings: they are dropped rather than failing the replica)."""
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    dropped = sorted(set(kwargs) - set(params))
    if dropped:
        log.info("engine factory %s does not take %s; ignored", getattr(factory, "__qualname__", factory),
                 ", ".join(dropped))
    return {k: v for k, v in kwargs.items() if k in params}


def engines_per_gpu_group(load, devices: list[int], tensor_parallel_size: int):
    """One engine per `tensor_parallel_size` GPUs (loaded in parallel), served as one engine.

    8 GPUs with tensor_parallel_size 8 -> one engine over all of them; with 1 -> eight
    single-GPU engines behind an `EngineGroup` (8 slots).
    """
    tp = max(1, tensor_parallel_size)
    if len(devices) % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the {len(devices)} GPUs Ray granted")
    groups = [devices[i:i + tp] for i in range(0, len(devices), tp)]
    if len(groups) == 1:
        return load(groups[0])
    from concurrent.futures import ThreadPoolExecutor

    from replicas.engine_group import EngineGroup

    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        return EngineGroup(list(pool.map(load, groups)))


class ReplicaActor:
    """Engine + replica gRPC server in one Ray actor process (see module docstring)."""

    def __init__(self, spec: ReplicaSpec):
        import ray

        from replicas.server import ReplicaServer

        self.spec = spec
        self.started_at = time.time()
        # ids Ray granted on this node; Ray already restricted CUDA_VISIBLE_DEVICES to them
        self.gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        devices = list(range(len(self.gpu_ids)))
        self.engine = make_engine(spec, devices)
        host = spec.host or self.node_ip
        self.server = ReplicaServer(self.engine, host=host, port=spec.port, replica_id=spec.replica_id,
                                    model_name=spec.model_name, model_path=spec.model, gpu_ids=self.gpu_ids,
                                    **spec.extra)
        self.port = self.server.start()
        self.address = f"{host}:{self.port}"
        self.draining = False
        log.info("replica %s serving %s on %s (GPUs %s)", spec.replica_id, self.engine.kind, self.address,
                 self.gpu_ids)

    # -- Ray methods -----------------------------------------------------------------------------

    def ready(self) -> dict:
        """Returns `info()` once the engine is loaded and the server listens (Ray runs __init__ first)."""
        return self.info()

    def info(self) -> dict:
        return {
            "replica_id": self.spec.replica_id,
            "address": self.address,
            "engine": self.engine.kind,
            "gpu_ids": self.gpu_ids,
            "node_id": self.node_id,
            "node_ip": self.node_ip,
            "pid": os.getpid(),
            "max_batch": self.engine.max_batch,
            "model": self.spec.model,
            "started_at": self.started_at,
            "draining": self.draining,
            "metrics": f"http://{self.node_ip}:{self.server.metrics_port}/metrics" if self.server.metrics_port else None,
            "spec": asdict(self.spec),
        }

    def health(self) -> dict:
        """Cheap liveness + load probe: {healthy, busy, draining}."""
        busy, healthy = self._load()
        return {"healthy": healthy, "busy": busy, "draining": self.draining}

    def drain(self, timeout_s: float = 600.0) -> int:
        """Refuse new requests, wait until running ones finish; returns how many still run."""
        self.draining = True
        self.server.drain()
        self.server.wait_idle(timeout_s)
        return self.server.busy_slots()

    def stop(self, grace_s: float = 5.0) -> None:
        self.draining = True
        self.server.stop(grace=grace_s)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    # -- internals -------------------------------------------------------------------------------

    def _load(self) -> tuple[int, bool]:
        """(running generations, engine healthy) as the replica server counts them."""
        return self.server.busy_slots(), bool(self.server.servicer.load.healthy)


def remote_class():
    """`ReplicaActor` as a Ray actor class (threaded: health answers during a drain)."""
    import ray

    return ray.remote(max_concurrency=4, max_restarts=0)(ReplicaActor)
