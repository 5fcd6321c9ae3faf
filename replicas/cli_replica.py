"""`monoserve replica`: serve one engine over gRPC (the Replica service) until stopped.

    monoserve replica --model DIR --port 50051 [--engine reference|monokernel|paced]
                      [--host 0.0.0.0] [--metrics-port 9100] [--devices 0,1] [--max-batch 1]

`--engine monokernel --max-batch B` (2..8) serves B requests decoded together on one GPU
(replicas/monokernel_batched.py, agent-session reuse per slot); B = 1 is the single-sequence engine
(tensor parallel over several --devices, agent-session reuse on one).

Also runnable as `python -m replicas.cli_replica ...`. Prints one line
`replica <id> ready on <host:port> ...` once serving (scripts and tests wait for it).
SIGTERM/SIGINT: drain (no new requests), let running ones finish for up to --grace seconds, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

ENGINES = ("reference", "monokernel", "paced")


class EngineUnavailable(RuntimeError):
    """The chosen engine cannot run here (e.g. monokernel without CuPy or a GPU)."""


def _devices(text: str) -> list[int]:
    try:
        devices = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--devices must be comma-separated GPU ordinals like 0,1; got {text!r}")
    if not devices or any(d < 0 for d in devices):
        raise argparse.ArgumentTypeError(f"--devices must list GPU ordinals >= 0 like 0,1; got {text!r}")
    return devices


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (optional for --engine paced)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port; default 50051)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to accept remote routers)")
    p.add_argument("--engine", choices=ENGINES, default="reference", help="engine kind (default reference)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--devices", type=_devices, default=[0], help="GPU ordinals for monokernel, e.g. 0,1 (default 0)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="concurrent generations (default 1); monokernel: 2..8 decodes that many together on one GPU "
                        "(BatchedMonokernelEngine: more aggregate tokens/s, slower per request)")
    p.add_argument("--resident", action="store_true",
                   help="monokernel with --max-batch 2..8: requests join a running batch launch without a relaunch "
                        "(its batch builds leave SMs to the joiners' prefill)")
    p.add_argument("--replica-id", default=None, help="id reported in load and info (default host:port)")
    p.add_argument("--model-name", default=None, help="model name reported by GetInfo (default: directory name)")
    p.add_argument("--tokens-per-s", type=float, default=1000.0, help="paced engine: output rate")
    p.add_argument("--grace", type=float, default=30.0, help="seconds running requests get on shutdown")
    # default None: the engine's default (replicas.session_cache.session_limits)
    p.add_argument("--session-cache-mb", type=float, default=None,
                   help="reference and single-GPU monokernel engines (batched too): MiB of agent-session KV kept "
                        "between turns (default 1024; GPU memory on the monokernel)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="reference and single-GPU monokernel engines (batched too): agent sessions kept between "
                        "turns, LRU (default 64; 0 = no reuse)")


def register(sub) -> None:
    """Add the `replica` subcommand to the `monoserve` CLI's subparsers."""
    if "replica" in sub.choices:  # already registered (e.g. by replicas.cli_cmds calling this)
        return
    p = sub.add_parser("replica", help="serve one engine over gRPC (Replica service)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def make_engine(args: argparse.Namespace):
    """Build the engine the arguments ask for; raises EngineUnavailable / ConfigError with a fix."""
    from replicas.session_cache import session_limits

    if args.max_batch < 1:
        raise EngineUnavailable(f"--max-batch must be >= 1, got {args.max_batch}")
    resident = bool(getattr(args, "resident", False))  # (`generate` has no such flag)
    if resident and (args.engine != "monokernel" or args.max_batch < 2):
        raise EngineUnavailable("--resident is for the batched monokernel: use --engine monokernel --max-batch 2..8")
    if args.engine == "paced":
        from replicas.testing import PacedEngine
        kw = dict(tokens_per_s=args.tokens_per_s, max_batch=args.max_batch)
        return PacedEngine.from_pretrained(args.model, **kw) if args.model else PacedEngine(**kw)
    if not args.model:
        raise EngineUnavailable(f"--model DIR is required for --engine {args.engine}")
    sessions = session_limits(getattr(args, "session_cache_mb", None),  # `generate` has no such flags
                              getattr(args, "max_sessions", None))
    if args.engine == "reference":
        from replicas.reference import ReferenceEngine
        return ReferenceEngine.from_pretrained(args.model, max_batch=args.max_batch, **sessions)
    check_monokernel_batch(args.max_batch, args.devices)  # before CuPy, the GPU and the weights
    try:
        import cupy  # noqa: F401  (checked first: the monokernel module needs it)
    except ImportError:
        raise EngineUnavailable("--engine monokernel needs CuPy and an NVIDIA GPU: install `monoserve[gpu]` "
                                "(cupy-cuda13x) on a GPU machine, or use --engine reference") from None
    try:
        from replicas.monokernel import MonokernelEngine, MonokernelUnavailable
        from replicas.monokernel_batched import BatchedMonokernelEngine
    except ModuleNotFoundError as e:
        if e.name not in ("replicas.monokernel", "replicas.monokernel_batched"):
            raise
        raise EngineUnavailable(f"this build has no monokernel engine ({e.name}); use --engine reference") from None
    try:
        if args.max_batch > 1:
            return BatchedMonokernelEngine.from_pretrained(args.model, batch=args.max_batch, devices=args.devices,
                                                           resident=resident, **sessions)
        return MonokernelEngine.from_pretrained(args.model, devices=args.devices, **sessions)  # ignored over TP
    except MonokernelUnavailable as e:  # CuPy imports but finds no usable GPU
        raise EngineUnavailable(str(e)) from None


def check_monokernel_batch(max_batch: int, devices: list[int]) -> None:
    """Refuse --max-batch combinations the monokernel cannot serve (replicas.monokernel_choice)."""
    from replicas.monokernel_choice import batch_problem

    problem = batch_problem(
        max_batch, "--max-batch",
        tensor_parallel=f"--devices {','.join(map(str, devices))}" if len(devices) > 1 else None,
        one_gpu_fix="give one GPU (e.g. --devices 0) and run one replica per GPU behind the router")
    if problem:
        raise EngineUnavailable(problem)


def run(args: argparse.Namespace) -> int:
    from replicas.model import ConfigError
    from replicas.server import ReplicaServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = make_engine(args)
    except (EngineUnavailable, ConfigError, ValueError, OSError) as e:
        print(f"monoserve replica: error: {e}", file=sys.stderr)
        return 2
    server = ReplicaServer(engine, host=args.host, port=args.port, replica_id=args.replica_id,
                           metrics_port=args.metrics_port, model_name=args.model_name, model_path=args.model,
                           gpu_ids=args.devices if args.engine == "monokernel" else ())
    try:
        server.start()
    except OSError as e:
        print(f"monoserve replica: error: {e} (is the port in use? pick another --port)", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    metrics = f" metrics :{server.metrics_port}" if server.metrics_port else ""
    print(f"replica {server.replica_id} ready on {server.address} engine={engine.kind} "
          f"max_batch={engine.max_batch}{metrics}", flush=True)
    while not stop.wait(0.5):
        pass
    server.drain()  # readiness NOT_SERVING: routers stop sending; running requests finish
    server.wait_idle(timeout=args.grace)
    server.stop(grace=1.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="monoserve replica", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
