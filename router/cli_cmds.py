"""`monoserve` subcommands of the router: `router`, and `generate --router ADDR` (remote generate).

    monoserve router --replica 127.0.0.1:50051 --replica 127.0.0.1:50052 --port 50050 \\
                     [--model DIR] [--http-port 8000] [--metrics-port 9200] [--queue-size 64]
    monoserve generate --router 127.0.0.1:50050 "Once upon a time" [--max-tokens 64]

`router` prints one line `router ready on <host:port> ...` once serving; SIGTERM/SIGINT stop it.
`generate --router` streams the text to stdout and prints TTFT and tokens/s to stderr. The
local `generate` (replicas/cli_cmds.py) hands over to `generate_remote` when --router is given.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time


def register(sub) -> None:
    p = sub.add_parser("router", help="serve the client-facing gRPC API in front of replicas",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replica", action="append", default=[], metavar="ADDR",
                   help="replica host:port (repeat for several; more can be added via RouterAdmin)")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (0 = any free port; default 50050)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 to accept remote clients)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="checkpoint directory whose tokenizer.json (and chat template) the router uses; "
                        "without it only token-id prompts are accepted")
    p.add_argument("--model-name", default="", help="model id clients use (default: the --model directory name)")
    p.add_argument("--http-port", type=int, default=None, help="also serve the OpenAI-compatible HTTP API here")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--queue-size", type=int, default=64,
                   help="requests that may wait for a free replica before RESOURCE_EXHAUSTED (default 64)")
    p.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a replica not ready this long after it was added counts as ejected: requests stop "
                        "waiting for it (it is still retried and admitted when it comes up; default 10)")
    p.set_defaults(func=run_router)


def run_router(args: argparse.Namespace) -> int:
    from router.detokenizer import TokenizerError
    from router.server import RouterServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.queue_size < 0:
        return _fail("--queue-size must be >= 0")
    if not args.connect_timeout > 0:
        return _fail(f"--connect-timeout must be > 0 seconds, got {args.connect_timeout}")
    server = RouterServer(args.replica, host=args.host, port=args.port, http_port=args.http_port,
                          metrics_port=args.metrics_port, tokenizer=args.model, model_name=args.model_name,
                          queue_size=args.queue_size, connect_timeout_s=args.connect_timeout)
    try:
        server.start()
    except TokenizerError as e:
        return _fail(str(e))
    except OSError as e:
        return _fail(f"{e} (is the port in use? pick another --port)")
    except Exception as e:  # noqa: BLE001 - e.g. a bad --replica address: say what, not a traceback
        message = getattr(e, "message", None) or str(e)
        return _fail(message)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    extras = "".join(f" {name}=:{port}" for name, port in (("http", server.http_port),
                                                           ("metrics", server.metrics_port)) if port)
    print(f"router ready on {server.address} replicas={len(args.replica)}{extras}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


def generate_remote(args: argparse.Namespace, out=None, err=None) -> int:
    """Stream a completion from a router; TTFT and tokens/s to `err`."""
    import grpc
    from monoserve.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    out = out or sys.stdout
    err = err or sys.stderr
    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                         top_k=args.top_k, ignore_eos=args.ignore_eos)
    if args.top_p != 1.0:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    req = inference_pb2.GenerateRequest(text=args.prompt, sampling=sampling)
    timeout = getattr(args, "timeout", None)
    start = time.perf_counter()
    first = None
    n = 0
    final = None
    with grpc.insecure_channel(args.router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(req, timeout=timeout, wait_for_ready=False)
        try:
            for msg in call:
                if msg.HasField("final"):
                    final = msg.final
                    continue
                if msg.chunk.token_ids and first is None:
                    first = time.perf_counter()
                n += len(msg.chunk.token_ids)
                piece = " ".join(map(str, msg.chunk.token_ids)) + " " if args.tokens else msg.chunk.text
                print(piece, end="", file=out, flush=True)
        except KeyboardInterrupt:
            call.cancel()
        except grpc.RpcError as e:
            print(file=out)
            return _fail(f"router {args.router}: {e.code().name}: {e.details()}")
    end = time.perf_counter()
    print(file=out, flush=True)
    reason = common_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_").lower() \
        if final else "cancelled"
    prompt = final.usage.prompt_tokens if final else "?"
    if first is None:
        print(f"[{prompt} prompt tokens, no tokens generated, finish={reason}]", file=err)
        return 0
    decode = f"{(n - 1) / (end - first):.1f} tokens/s decode" if n > 1 else "decode n/a"
    replica = f", replica {final.replica_id}" if final and final.replica_id else ""
    print(f"[{prompt} prompt tokens, {n} generated in {end - start:.2f} s: TTFT {1000 * (first - start):.1f} ms, "
          f"{decode}, {n / (end - start):.1f} tokens/s overall, finish={reason}{replica}]", file=err)
    return 0


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
