"""The supervisor: a thin loop that gathers a snapshot, asks `supervision.plan`, and acts.

It owns the router actor and the replica actors (each in its own STRICT_PACK placement group).
Every `interval_s` one round: poll replica readiness and health (non-blocking Ray calls), read
the router's pool and queue over RouterAdmin, build a `Snapshot`, then execute the planned
actions (start, register, drain, remove). It runs inside the named `SupervisorActor` so that
`monoserve status` / `down` from any shell find it; tests can also drive `run_round()` directly.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import grpc
import ray
from monoserve.v1 import admin_pb2
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig
from cluster.router_actor import (
    HEAD_NODE_RESOURCE,
    ROUTER_ACTOR_NAME,
    RouterActor,
    RouterAdminClient,
)
from cluster.supervision import (
    Drain,
    Memory,
    Phase,
    Policy,
    Register,
    Remove,
    ReplicaView,
    Snapshot,
    Start,
    plan,
)
from replicas.actor import placement_bundle, remote_class

log = logging.getLogger("monoserve.supervisor")
REPLICA_PREFIX = "monoserve-replica-"
SUPERVISOR_ACTOR_NAME = "monoserve-supervisor"


@dataclass
class ManagedReplica:
    name: str
    actor: object
    pg: object
    started_at: float
    phase: Phase = Phase.STARTING
    ready_ref: object | None = None
    health_ref: object | None = None
    last_healthy_at: float | None = None
    address: str | None = None
    info: dict = field(default_factory=dict)
    busy: int = 0
    error: str | None = None


def policy_from(config: ClusterConfig) -> Policy:
    a = config.autoscaling
    return Policy(min_replicas=config.replicas.min, max_replicas=config.replicas.max, autoscale=a.enabled,
                  scale_up_after_s=a.scale_up_after_s, scale_down_idle_s=a.scale_down_idle_s,
                  health_timeout_s=a.health_timeout_s, start_timeout_s=a.start_timeout_s)


class Supervisor:
    def __init__(self, config: ClusterConfig, clock=time.monotonic):
        self.config = config
        self.policy = policy_from(config)
        self.memory = Memory(target=self.policy.min_replicas)
        self.clock = clock
        self.replicas: dict[str, ManagedReplica] = {}
        self.events: deque[str] = deque(maxlen=200)
        self.start_errors: deque[str] = deque(maxlen=20)  # "name: error" of failed starts, newest last
        self.queue_depth = 0
        self.router_pool: dict[str, admin_pb2.ReplicaStatus] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_router()
        self._adopt_replicas()

    # -- lifecycle -------------------------------------------------------------------------------

    def _start_router(self) -> None:
        r = self.config.router
        self.router = ray.remote(RouterActor).options(
            # Ray restarts a crashed router (same args, so the same port when one is configured);
            # the next round finds its pool empty and registers every ready replica again
            # get_if_exists: a restarted supervisor takes over the router that kept serving
            name=ROUTER_ACTOR_NAME, lifetime="detached", num_cpus=r.cpus, max_restarts=-1,
            get_if_exists=True, resources={HEAD_NODE_RESOURCE: 0.001},
        ).remote(r.host, r.port, r.http_port, r.metrics_port,
                 str(self.config.model) if self.config.model else None, self.config.served_model_name, r.queue_size)
        self.router_addresses = ray.get(self.router.addresses.remote(), timeout=120)
        self.admin = RouterAdminClient(self.router_addresses["grpc"])
        self._event(f"router serving on {self.router_addresses['grpc']}")

    def _adopt_replicas(self) -> None:
        """After a supervisor restart: take over the replica actors that kept running."""
        namespace = ray.get_runtime_context().namespace
        now = self.clock()
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"]
            if entry["namespace"] != namespace or not name.startswith(REPLICA_PREFIX):
                continue
            try:
                actor = ray.get_actor(name, namespace=namespace)
                pg = ray.util.get_placement_group(name)
            except ValueError:  # gone meanwhile
                continue
            self.replicas[name] = ManagedReplica(name, actor, pg, started_at=now, ready_ref=actor.ready.remote())
            self._event(f"{name} adopted (kept running while the supervisor restarted)")
        if self.replicas:
            target = min(max(len(self.replicas), self.policy.min_replicas), self.policy.max_replicas)
            self.memory = Memory(target=target)

    def start(self) -> None:
        """Run rounds in a background thread until `shutdown()`."""
        self.run_round()
        self._thread = threading.Thread(target=self._loop, name="monoserve-supervisor", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.config.autoscaling.interval_s):
            try:
                self.run_round()
            except Exception as e:  # a bad round must not kill supervision; the next one retries
                log.exception("supervision round failed")
                self._event(f"round failed: {e}")

    def shutdown(self) -> None:
        """Stop supervising, stop replicas (no drain: `down` is an explicit stop) and the router."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            for name in list(self.replicas):
                self._remove(name, "shutdown")
            try:
                ray.get(self.router.stop.remote(), timeout=10)
            except ray.exceptions.RayError as e:  # killed below anyway
                log.warning("router did not stop cleanly: %s", _short(e))
            ray.kill(self.router)
            self.admin.close()

    # -- one round -------------------------------------------------------------------------------

    def run_round(self) -> list:
        with self._lock:
            now = self.clock()
            self._poll_replicas(now)
            self._poll_router()
            views = tuple(self._view(r) for r in self.replicas.values())
            actions, self.memory = plan(Snapshot(now, views, self.queue_depth), self.memory, self.policy)
            for action in actions:
                self._execute(action, now)
            return actions

    def _poll_replicas(self, now: float) -> None:
        for r in self.replicas.values():
            if r.phase is Phase.STARTING and _done(r.ready_ref):
                try:
                    r.info = ray.get(r.ready_ref)
                    r.address, r.phase, r.last_healthy_at = r.info["address"], Phase.READY, now
                    if r.info.get("draining"):  # adopted after a restart while it was draining
                        r.phase = Phase.DRAINING
                    self._event(f"{r.name} ready at {r.address} ({r.info['engine']}, GPUs {r.info['gpu_ids']})")
                except ray.exceptions.RayError as e:  # the actor's constructor failed or it died
                    r.phase, r.error = Phase.DEAD, _short(e)
                    self.start_errors.append(f"{r.name}: {r.error}")
                    self._event(f"{r.name} failed to start: {r.error}")
            elif r.phase in (Phase.READY, Phase.DRAINING):
                if r.health_ref is not None and _done(r.health_ref):
                    try:
                        h = ray.get(r.health_ref)
                        r.busy = h["busy"]
                        if h["draining"] and r.phase is Phase.READY:  # adopted mid-drain
                            r.phase = Phase.DRAINING
                        if h["healthy"]:
                            r.last_healthy_at = now
                    except ray.exceptions.RayActorError as e:
                        r.phase, r.error = Phase.DEAD, _short(e)
                        self._event(f"{r.name} died")
                    except ray.exceptions.RayError as e:  # the health call itself failed: unhealthy
                        r.error = _short(e)
                    r.health_ref = None
                if r.health_ref is None and r.phase is not Phase.DEAD:
                    r.health_ref = r.actor.health.remote()

    def _poll_router(self) -> None:
        try:
            reply = self.admin.list()
        except grpc.RpcError:
            self._reconnect_router()  # raises while the router is still restarting
            reply = self.admin.list()
        self.queue_depth = reply.queue_depth
        self.router_pool = {s.address: s for s in reply.replicas}

    def _view(self, r: ManagedReplica) -> ReplicaView:
        entry = self.router_pool.get(r.address) if r.address else None
        busy = r.busy
        if entry is not None:
            busy = max(busy, entry.router_running, entry.load.busy_slots)
        return ReplicaView(r.name, r.phase, r.started_at, address=r.address, registered=entry is not None,
                           busy=busy, last_healthy_at=r.last_healthy_at)

    def _reconnect_router(self) -> None:
        addresses = ray.get(self.router.addresses.remote(), timeout=5)
        if addresses != self.router_addresses:
            self._event(f"router restarted, now serving on {addresses['grpc']}")
        self.router_addresses = addresses
        self.admin.close()
        self.admin = RouterAdminClient(addresses["grpc"])
        self.router_pool = {}

    # -- actions ---------------------------------------------------------------------------------

    def _execute(self, action, now: float) -> None:
        if isinstance(action, Start):
            for _ in range(action.count):
                self._start_replica(now)
        elif isinstance(action, Register):
            r = self.replicas[action.name]
            self.admin.add(r.address)
            self._event(f"{r.name} registered with the router")
        elif isinstance(action, Drain):
            r = self.replicas[action.name]
            r.phase = Phase.DRAINING
            self.admin.remove(r.address, drain=True)  # router: no new requests, running ones finish
            r.actor.drain.remote()
            self._event(f"{r.name} draining (idle; scaling down to {self.memory.target})")
        elif isinstance(action, Remove):
            self._remove(action.name, action.reason)

    def _start_replica(self, now: float) -> None:
        cfg = self.config
        rs = cfg.replicas
        name = REPLICA_PREFIX + uuid.uuid4().hex[:6]
        pg = placement_group([placement_bundle(rs.gpus_per_replica, rs.cpus_per_replica)],
                             strategy="STRICT_PACK", name=name, lifetime="detached")
        spec = cfg.replica_spec(name.removeprefix("monoserve-"))
        actor = remote_class().options(
            name=name, lifetime="detached", num_cpus=rs.cpus_per_replica, num_gpus=rs.gpus_per_replica,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote(spec)
        self.replicas[name] = ManagedReplica(name, actor, pg, started_at=now, ready_ref=actor.ready.remote())
        self._event(f"{name} starting ({rs.gpus_per_replica} GPUs)")

    def _remove(self, name: str, reason: str) -> None:
        r = self.replicas.pop(name)
        if r.address:
            try:
                self.admin.remove(r.address, drain=False)  # running requests fail over in the router
            except grpc.RpcError as e:
                self._event(f"{name}: router did not confirm removal: {_short(e)}")
        if r.phase is not Phase.DEAD:
            try:
                ray.get(r.actor.stop.remote(), timeout=10)
            except ray.exceptions.RayError as e:  # killed right below anyway
                log.info("%s did not stop cleanly: %s", name, _short(e))
        ray.kill(r.actor)
        if r.pg is not None:
            remove_placement_group(r.pg)
        self._event(f"{name} removed ({reason})")

    # -- reporting -------------------------------------------------------------------------------

    def _event(self, text: str) -> None:
        log.info(text)
        self.events.append(f"{time.strftime('%H:%M:%S')} {text}")

    def status(self) -> dict:
        with self._lock:
            replicas = []
            for r in self.replicas.values():
                entry = self.router_pool.get(r.address) if r.address else None
                replicas.append({
                    "name": r.name, "phase": r.phase.value, "address": r.address,
                    "engine": r.info.get("engine"), "gpu_ids": r.info.get("gpu_ids", []),
                    "node_ip": r.info.get("node_ip"), "busy": self._view(r).busy,
                    "capacity": r.info.get("max_batch"), "metrics": r.info.get("metrics"),
                    "router_state": _state_name(entry.state) if entry is not None else None,
                    "error": r.error,
                })
            return {"router": dict(self.router_addresses, queue_depth=self.queue_depth),
                    "target": self.memory.target, "min": self.policy.min_replicas,
                    "max": self.policy.max_replicas, "replicas": replicas, "events": list(self.events),
                    "start_errors": list(self.start_errors)}


class SupervisorActor:
    """The supervisor as a named detached Ray actor (threaded: status answers during a round)."""

    def __init__(self, config_json: str):
        logging.basicConfig(level=logging.INFO)
        self.supervisor = Supervisor(ClusterConfig.model_validate_json(config_json))
        self.supervisor.start()

    def status(self) -> dict:
        return self.supervisor.status()

    def config(self) -> str:
        return self.supervisor.config.model_dump_json()

    def shutdown(self) -> None:
        self.supervisor.shutdown()


def _done(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:300]


def _state_name(state: int) -> str:
    return admin_pb2.ReplicaState.Name(state).removeprefix("REPLICA_STATE_").lower()

