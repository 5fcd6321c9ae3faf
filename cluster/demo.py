"""`monoserve demo`: the whole serving path on one CPU machine in about a minute.

A local Ray cluster with 16 logical GPUs, the router, two replicas (8 GPUs each) running the
numpy reference engine on a tiny synthetic model, a few concurrent streamed text requests
through the router's gRPC API, per-request TTFT and tokens/s, then a clean shutdown.
The tiny model has random weights: its text is gibberish, the timings and the path are real.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from pathlib import Path

PROMPTS = [
    "The quickest way to serve a language model is",
    "Agents call tools, read the answers and",
    "A persistent kernel keeps every layer on the GPU so",
    "Routing each request to an idle node means",
    "Memory bandwidth bounds decode speed because",
    "Eight GPUs in one node talk over NVLink and",
]
LINE_WIDTH = 72


def demo_checkpoint() -> Path:
    """The tiny model, made once into a cache directory."""
    from replicas.checkpoint import make_checkpoint

    root = Path(__file__).resolve().parents[1]
    base = Path(os.environ.get("MONOSERVE_CACHE", root / ".cache"))
    if not os.access(base.parent if not base.exists() else base, os.W_OK):
        base = Path.home() / ".cache" / "monoserve"
    path = base / "tiny"
    if not (path / "config.json").is_file() or not (path / "tokenizer.json").is_file():
        print(f"making the tiny demo model in {path} ...", flush=True)
        make_checkpoint("tiny", path, seed=0)
    return path


def demo_config(model: Path):
    from cluster.config import ClusterConfig

    return ClusterConfig.parse({
        "model": str(model), "engine": "reference", "model_name": "tiny",
        "replicas": {"min": 2, "max": 2, "gpus_per_replica": 8, "cpus_per_replica": 0.5},
        "router": {"host": "127.0.0.1", "port": 0, "cpus": 0.5},
        "autoscaling": {"enabled": False, "interval_s": 0.5},
        "ray": {"num_gpus": 16, "num_cpus": max(4, os.cpu_count() or 1)},
    }, source="demo")


def stream_one(stub, index: int, prompt: str, max_tokens: int, out: queue.Queue) -> None:
    """Run one streamed request; report text pieces and the final stats through `out`."""
    from monoserve.v1 import common_pb2, inference_pb2

    req = inference_pb2.GenerateRequest(text=prompt, request_id=f"demo-{index}",
                                        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sent = time.perf_counter()
    first = None
    try:
        for msg in stub.Generate(req, timeout=60):
            if msg.HasField("chunk"):
                first = first or time.perf_counter()
                out.put((index, "text", msg.chunk.text))
            else:
                end = time.perf_counter()
                n = msg.final.usage.completion_tokens
                rate = (n - 1) / (end - first) if first and n > 1 and end > first else 0.0
                out.put((index, "done", {
                    "ttft_ms": (first - sent) * 1e3 if first else float("nan"), "tokens": n, "tokens_per_s": rate,
                    "replica": msg.final.replica_id, "finish": common_pb2.FinishReason.Name(msg.final.finish_reason)}))
    except Exception as e:  # noqa: BLE001 -- any failure is shown to the user; the demo goes on
        out.put((index, "error", str(e)))


def run_requests(router_address: str, num_requests: int, max_tokens: int) -> list[dict]:
    """Concurrent streamed requests; prints text as it streams, one line per request at a time."""
    import grpc
    from monoserve.v1 import inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(router_address))
    out: queue.Queue = queue.Queue()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    threads = [threading.Thread(target=stream_one, args=(stub, i, p, max_tokens, out), daemon=True)
               for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        print(f"[{i}] prompt: {p!r}")
    for t in threads:
        t.start()
    pending = {i: "" for i in range(num_requests)}
    stats: dict[int, dict] = {}
    while len(stats) < num_requests:
        i, kind, value = out.get(timeout=90)
        if kind == "text":
            pending[i] += value
            if len(pending[i]) >= LINE_WIDTH:
                print(f"[{i}] {pending[i]!r}", flush=True)
                pending[i] = ""
        else:
            if pending[i]:
                print(f"[{i}] {pending[i]!r}", flush=True)
            stats[i] = value if kind == "done" else {"error": value}
    return [stats[i] for i in range(num_requests)]


def print_stats(stats: list[dict]) -> None:
    print("\nTTFT is measured by the client and includes queueing (2 replicas x 1 slot each);"
          " tokens/s is the decode rate after the first token.")
    print(f"{'req':>3}  {'replica':<16} {'TTFT ms':>8} {'tokens':>6} {'tokens/s':>9}  finish")
    for i, s in enumerate(stats):
        if "error" in s:
            print(f"{i:>3}  failed: {s['error']}")
        else:
            print(f"{i:>3}  {s['replica']:<16} {s['ttft_ms']:>8.1f} {s['tokens']:>6} {s['tokens_per_s']:>9.1f}  "
                  f"{s['finish'].removeprefix('FINISH_REASON_').lower()}")


def run_demo(num_requests: int = 4, max_tokens: int = 48) -> int:
    import ray

    from cluster import launcher

    model = demo_checkpoint()
    config = demo_config(model)
    print("starting a local Ray cluster (16 logical GPUs) ...", flush=True)
    launcher.connect(config)
    started = time.perf_counter()
    try:
        launcher.up(config, progress=_progress_printer(config.replicas.min), timeout_s=120)
        print(f"\nup in {time.perf_counter() - started:.1f}s\n{launcher.format_status(launcher.status())}\n",
              flush=True)
        stats = run_requests(launcher.status()["router"]["grpc"], num_requests, max_tokens)
        print_stats(stats)
        ok = all("error" not in s for s in stats)
    except launcher.ClusterError as e:
        print(f"monoserve demo: {e}", file=sys.stderr)
        ok = False
    finally:
        print("\nshutting down ...", flush=True)
        launcher.down(config.ray.namespace)
        ray.shutdown()
    print("done" if ok else "demo FAILED")
    return 0 if ok else 1


def _progress_printer(total: int):
    last = [None]

    def show(status):
        from cluster.launcher import serving

        ready = len(serving(status))
        line = f"replicas ready {ready}/{total}"
        if line != last[0]:
            print(line, flush=True)
            last[0] = line
    return show
