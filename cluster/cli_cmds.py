"""Subcommands of the cluster area: up, down, status, demo, bench."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="Start router + replicas on a Ray cluster (local one if no address).")
    p.add_argument("--config", type=Path, help="cluster YAML (see deploy/cluster.yaml)")
    p.add_argument("--address", help="Ray cluster to join ('auto', 'ray://head:10001'); default: config or local")
    p.add_argument("--model", type=Path, help="checkpoint directory (overrides the config)")
    p.add_argument("--engine", choices=["auto", "reference", "monokernel", "paced"], help="engine kind override")
    p.add_argument("--replicas", type=int, help="run exactly this many replicas (sets min and max)")
    p.add_argument("--port", type=int, help="router gRPC port override")
    p.add_argument("--http-port", type=int, help="router OpenAI-compatible HTTP port")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("status", help="Show router, replicas, their GPUs, load and health.")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--namespace", default="monoserve")
    p.add_argument("--events", action="store_true", help="also print the supervisor's recent events")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("down", help="Stop replicas, router and supervisor.")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    p.add_argument("--namespace", default="monoserve")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("demo", help="Local Ray, router, two CPU replicas of a tiny model, streamed requests.")
    p.add_argument("--requests", type=int, default=4, help="concurrent requests (default 4)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="Run a benchmark script: bench/decode.py or bench/router.py.")
    p.add_argument("which", choices=["decode", "router"])
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (see its --help)")
    p.set_defaults(func=cmd_bench)


def _load_config(args):
    from cluster.config import ClusterConfig

    if args.config:
        config = ClusterConfig.from_yaml(args.config)
    else:
        base = {"model": str(args.model) if args.model else None, "engine": args.engine}
        config = ClusterConfig.parse({k: v for k, v in base.items() if v is not None}, source="command line")
    overrides = {"model": str(args.model) if args.model else None, "engine": args.engine,
                 "ray.address": args.address, "router.port": args.port, "router.http_port": args.http_port}
    if args.replicas is not None:
        overrides.update({"replicas.min": args.replicas, "replicas.max": args.replicas})
    return config.with_overrides(**overrides)


def cmd_up(args) -> int:
    import ray
    from tqdm import tqdm

    from cluster import launcher
    from cluster.config import ClusterConfigError

    try:
        config = _load_config(args)
        local = launcher.connect(config)
    except (ClusterConfigError, launcher.ClusterError) as e:
        launcher.eprint(f"monoserve up: {e}")
        return 2
    bar = tqdm(total=config.replicas.min, desc="replicas ready", unit="replica", file=sys.stderr)

    shown = [None]

    def progress(status):
        ready = len(launcher.serving(status))
        starting = sum(r["phase"] == "starting" for r in status["replicas"])
        joining = sum(r["phase"] == "ready" for r in status["replicas"]) - ready  # router connecting
        if (ready, starting, joining) != shown[0]:  # redraw on change only (quiet in logs)
            shown[0] = (ready, starting, joining)
            bar.n = min(ready, bar.total)
            bar.set_postfix_str(f"{starting} loading, {joining} joining the router")

    try:
        launcher.up(config, progress=progress)
    except launcher.ClusterError as e:
        bar.close()
        launcher.eprint(f"monoserve up: {e}")
        return 1
    except KeyboardInterrupt:  # interrupted while starting: leave nothing half-started behind
        bar.close()
        launcher.eprint("monoserve up: interrupted; stopping what was started")
        launcher.down(config.ray.namespace)
        return 130
    bar.close()
    print(launcher.format_status(launcher.status(config.ray.namespace)), flush=True)
    if not local:
        print("monoserve is up; `monoserve status` shows it, `monoserve down` stops it.")
        return 0
    address = ray.get_runtime_context().gcs_address
    print(f"local Ray cluster at {address}: serving until Ctrl-C "
          f"(or `monoserve status|down --address {address}` from another shell)", flush=True)
    try:
        launcher.wait_until_down(config.ray.namespace)
    except KeyboardInterrupt:
        print("stopping...", flush=True)
        launcher.down(config.ray.namespace)
    ray.shutdown()
    return 0


def _token_auth_env() -> None:
    """Ray's token auth (on by default for local clusters): a client joining by address sends the
    token (~/.ray/auth_token or RAY_AUTH_TOKEN) only in token mode, which Ray reads at import —
    so call this before anything imports ray."""
    if "RAY_AUTH_MODE" not in os.environ and (
            "RAY_AUTH_TOKEN" in os.environ or (Path.home() / ".ray" / "auth_token").is_file()):
        os.environ["RAY_AUTH_MODE"] = "token"


def _join(address: str, namespace: str) -> None:
    import ray

    if ray.is_initialized():  # already connected (e.g. called in-process)
        return

    from cluster.launcher import ClusterError, worker_runtime_env

    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, runtime_env=worker_runtime_env(),
                 configure_logging=False)
    except ConnectionError as e:
        raise ClusterError(f"no Ray cluster at {address!r} ({e}): is monoserve up?") from None


def cmd_status(args) -> int:
    _token_auth_env()
    from cluster import launcher

    try:
        _join(args.address, args.namespace)
        s = launcher.status(args.namespace)
    except launcher.ClusterError as e:
        launcher.eprint(f"monoserve status: {e}")
        return 1
    print(launcher.format_status(s))
    if args.events:
        print("events:\n  " + "\n  ".join(s["events"][-30:]))
    return 0


def cmd_down(args) -> int:
    _token_auth_env()
    from cluster import launcher

    try:
        _join(args.address, args.namespace)
    except launcher.ClusterError as e:
        launcher.eprint(f"monoserve down: {e}")
        return 1
    found = launcher.down(args.namespace)
    print("monoserve stopped" if found else "monoserve was not running")
    return 0


def cmd_demo(args) -> int:
    from cluster.demo import run_demo

    return run_demo(num_requests=args.requests, max_tokens=args.max_tokens)


def cmd_bench(args) -> int:
    script = ROOT / "bench" / f"{args.which}.py"
    if not script.is_file():
        print(f"monoserve bench: {script} is missing in this checkout", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(script), *args.args])
