"""`monoserve up / status / down`: connect to Ray, start or find the supervisor, report.

`up` without a Ray address starts a local Ray cluster in this process (logical GPUs on a
machine without them) and keeps running until Ctrl-C or `monoserve down`; with an address it
creates the detached supervisor on that cluster and returns. `status` and `down` find the
supervisor by name (namespace `monoserve`) from any shell on the cluster.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import ray

from cluster.config import ClusterConfig
from cluster.router_actor import ROUTER_ACTOR_NAME
from cluster.supervisor import REPLICA_PREFIX, SUPERVISOR_ACTOR_NAME, SupervisorActor
from replicas.actor import cuda_available

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)

# Ray waits a fixed 30 s for a fresh raylet to register with its GCS, and by default 30 s for the
# GCS to write its port file; the first start from a cold virtualenv on a loaded small machine
# (CI: 2 cores) can miss either, so the GCS wait is lengthened and a local start is retried.
LOCAL_START_ATTEMPTS = 3
GCS_PORT_WAIT_S = "90"  # RAY_gcs_server_port_wait_time_s, unless the operator set it
# Serve's controller kills a proxy that is not ready 5 s after it was created, and `serve.start` then fails with
# the proxy's ActorDiedError; a proxy importing our gRPC servicer on a loaded 2-core machine can take longer.
SERVE_PROXY_READY_S = "30"  # RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, unless the operator set it; workers inherit it
STARTUP_TIMEOUT_MARKS = ("timed out during startup", "Timed out waiting for file")
RAY_PROCESS_MARKS = (b"gcs_server", b"raylet", b"/ray/", b"ray::")  # in the command lines Ray spawns


class ClusterError(RuntimeError):
    """A cluster operation failed; the message says what to do."""


def worker_runtime_env() -> dict:
    """Make this checkout importable in Ray workers (the `monoserve.v1` stubs live under proto/).

    Ray expands `${PYTHONPATH}` on the worker's node, so a node's own path is kept; paths of this
    checkout that do not exist on a remote node are simply skipped by Python there.
    """
    paths = [str(ROOT), str(ROOT / "proto"), "${PYTHONPATH}"]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}}


def local_gpu_count(config: ClusterConfig) -> int | None:
    """GPUs to give a local Ray: configured, else detected, else logical ones for the replicas."""
    if config.ray.num_gpus is not None:
        return config.ray.num_gpus
    if cuda_available():
        return None  # let Ray detect the real ones
    return config.replicas.gpus_per_replica * config.replicas.max


def connect(config: ClusterConfig, address: str | None = None) -> bool:
    """Join the configured/given Ray cluster or start a local one. Returns True if started here."""
    if ray.is_initialized():
        return False
    address = address or config.ray.address
    kwargs = {"namespace": config.ray.namespace, "runtime_env": worker_runtime_env(), "include_dashboard": False,
              "log_to_driver": False, "configure_logging": False}
    if address:
        try:
            ray.init(address=address, **kwargs)
        except ConnectionError as e:
            raise ClusterError(f"cannot connect to the Ray cluster at {address!r}: {e}. "
                               "Start it with `ray start --head` or fix ray.address / --address.") from None
        return False
    init_local_ray(num_gpus=local_gpu_count(config), num_cpus=config.ray.num_cpus, **kwargs)
    shortfall = _gpu_shortfall(config)
    if shortfall:
        ray.shutdown()
        raise ClusterError(f"{shortfall}: lower replicas.min / replicas.gpus_per_replica, "
                           "or set ray.num_gpus (logical GPUs) for a local cluster")
    return True


def init_local_ray(attempts: int = LOCAL_START_ATTEMPTS, **init_kwargs) -> None:
    """`ray.init(**init_kwargs)` for a new local cluster, retried when its node misses Ray's startup
    deadline. A failed start leaves the GCS and raylet it spawned running (Ray never got a handle
    on them), so they are stopped before the next attempt."""
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_PORT_WAIT_S)  # read by ray.init here
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", SERVE_PROXY_READY_S)  # by the Serve controller
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**init_kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception / RuntimeError for its startup deadlines
            if not any(mark in str(e) for mark in STARTUP_TIMEOUT_MARKS):
                raise
            _stop_spawned_ray_processes()
            if attempt == attempts:
                raise ClusterError(f"the local Ray node did not start in {attempts} attempts ({e}). "
                                   "Check free memory and /tmp/ray/session_latest/logs/raylet.out, "
                                   "or start Ray yourself (`ray start --head`) and pass --address.") from None
            log.warning("local Ray start attempt %d/%d timed out; retrying", attempt, attempts)


def _stop_spawned_ray_processes() -> None:
    """SIGKILL this process's children that are Ray's (gcs_server, raylet, its Python helpers)."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError, IndexError):
            continue  # gone already, or not ours to read
        if ppid == me and any(mark in cmdline for mark in RAY_PROCESS_MARKS):
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    ray.shutdown()


def get_supervisor(namespace: str = "monoserve"):
    try:
        return ray.get_actor(SUPERVISOR_ACTOR_NAME, namespace=namespace)
    except ValueError:
        return None


def up(config: ClusterConfig, progress=None, timeout_s: float | None = None):
    """Create the supervisor (router + replicas) and wait until `replicas.min` are ready.

    `progress(status_dict)` is called while waiting. Returns the supervisor actor handle.
    Raises ClusterError if monoserve is already up, a replica fails to start, or time runs out.
    """
    if get_supervisor(config.ray.namespace) is not None:
        raise ClusterError("monoserve is already up on this Ray cluster: run `monoserve down` first")
    supervisor = ray.remote(SupervisorActor).options(
        # restarted by Ray if it crashes; the new one adopts the router and replicas (still serving)
        name=SUPERVISOR_ACTOR_NAME, namespace=config.ray.namespace, lifetime="detached", num_cpus=0,
        max_concurrency=4, max_restarts=-1,
    ).remote(config.model_dump_json())
    timeout_s = timeout_s or config.autoscaling.start_timeout_s
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = ray.get(supervisor.status.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.RayActorError as e:
            down(config.ray.namespace)
            raise ClusterError(f"the supervisor failed to start: {_last_line(e)}") from None
        except ray.exceptions.GetTimeoutError:
            status = None
        if status is not None:
            if progress:
                progress(status)
            if status["start_errors"]:
                down(config.ray.namespace)
                raise ClusterError(f"replica failed to start: {status['start_errors'][0]}")
            if len(serving(status)) >= config.replicas.min:
                return supervisor
        if time.monotonic() > deadline:
            down(config.ray.namespace)
            hint = _gpu_shortfall(config) or "see the Ray logs (`ray logs`)"
            raise ClusterError(f"replicas not ready after {timeout_s:g}s: {hint}; "
                               "or raise autoscaling.start_timeout_s")
        time.sleep(0.2)


def serving(status: dict) -> list[dict]:
    """Replicas that are ready and that the router sends requests to."""
    return [r for r in status["replicas"] if r["phase"] == "ready" and r["router_state"] == "ready"]


def _gpu_shortfall(config: ClusterConfig) -> str | None:
    """Why the cluster cannot hold `replicas.min` replicas now, or None. (An autoscaling cluster
    may still add nodes, so for a remote cluster this is only a hint.)"""
    need = config.replicas.gpus_per_replica
    total = ray.cluster_resources().get("GPU", 0)
    if need and total < need * config.replicas.min:
        return f"the Ray cluster has {total:g} GPUs but {config.replicas.min} replicas x {need} GPUs are needed"
    return None


def status(namespace: str = "monoserve") -> dict:
    supervisor = get_supervisor(namespace)
    if supervisor is None:
        raise ClusterError("monoserve is not up on this Ray cluster (no supervisor): run `monoserve up`")
    deadline = time.monotonic() + 60
    while True:
        try:
            return ray.get(supervisor.status.remote(), timeout=30)
        except ray.exceptions.ActorUnavailableError:  # restarting after a crash: it comes back
            if time.monotonic() > deadline:
                raise ClusterError("the supervisor has been restarting for 60s: see `ray logs`") from None
            time.sleep(0.2)


def down(namespace: str = "monoserve") -> bool:
    """Stop replicas, router and supervisor; also cleans up leftovers of a crashed supervisor."""
    supervisor = get_supervisor(namespace)
    found = supervisor is not None
    if supervisor is not None:
        try:
            ray.get(supervisor.shutdown.remote(), timeout=120)
        except ray.exceptions.RayError as e:  # dead or stuck: the leftovers are killed below
            eprint(f"supervisor did not shut down cleanly ({_last_line(e)}); killing what is left")
        ray.kill(supervisor)
    for info in ray.util.list_named_actors(all_namespaces=True):
        name = info["name"]
        if info["namespace"] == namespace and (
                name.startswith(REPLICA_PREFIX) or name == ROUTER_ACTOR_NAME):
            found = True
            try:
                ray.kill(ray.get_actor(name, namespace=namespace))
            except ValueError:
                pass
    for pg in ray.util.placement_group_table().values():
        if pg.get("name", "").startswith(REPLICA_PREFIX) and pg.get("state") != "REMOVED":
            ray.util.remove_placement_group(ray.util.get_placement_group(pg["name"]))
    return found


def format_status(s: dict) -> str:
    lines = [f"router  {s['router']['grpc']}" + (f"  http {s['router']['http']}" if s['router'].get('http') else "")
             + f"  queue {s['router']['queue_depth']}",
             f"replicas  target {s['target']} (min {s['min']}, max {s['max']})"]
    header = f"  {'name':<24} {'phase':<9} {'router':<10} {'address':<22} {'engine':<11} {'load':<6} GPUs"
    lines.append(header)
    for r in s["replicas"]:
        load = f"{r['busy']}/{r['capacity']}" if r["capacity"] else "-"
        lines.append(f"  {r['name']:<24} {r['phase']:<9} {r['router_state'] or '-':<10} {r['address'] or '-':<22} "
                     f"{r['engine'] or '-':<11} {load:<6} {_gpus(r['gpu_ids'])}"
                     + (f"  ({r['error']})" if r["error"] else ""))
    return "\n".join(lines)


def _gpus(ids: list[int]) -> str:
    return ",".join(map(str, ids)) if ids else "-"


def _last_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def wait_until_down(namespace: str, poll_s: float = 1.0) -> None:
    """Block while the supervisor exists (the foreground `up` of a local cluster)."""
    while get_supervisor(namespace) is not None:
        time.sleep(poll_s)


def eprint(*args) -> None:
    print(*args, file=sys.stderr, flush=True)
