"""Router overhead benchmark: what the router adds on top of talking to a replica directly.

    python bench/router.py [--tokens-per-s 2000] [--requests 300] [--stream-tokens 2000] [--streams 5]
                           [--dispatch-seconds 5] [--concurrency 32] [--record bench/RESULTS.md]

Everything runs as real processes on loopback: PacedEngine replicas (`monoserve replica --engine
paced`: tokens at a fixed rate, so any difference is the serving path) and a router
(`monoserve router`); the client here uses grpc.aio.

1. TTFT added: client-side time to first token, router vs direct, p50/p99 over --requests
   sequential requests (prompt of 8 token ids, 1 output token).
2. tokens/s loss: client-side decode rate of --stream-tokens tokens at --tokens-per-s, router vs
   direct, p50/p99 over --streams sequential streams.
3. Sustained dispatch rate: requests/s through the router with tiny requests (1 output token)
   from --concurrency concurrent clients for --dispatch-seconds, to a replica with many slots.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "proto")]

import grpc  # noqa: E402
from monoserve.v1 import (common_pb2, inference_pb2, inference_pb2_grpc, replica_pb2,  # noqa: E402
                          replica_pb2_grpc)

ENV = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'proto'}"}
PROMPT = list(range(10, 18))


def start(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=ENV, cwd=ROOT)
    line = proc.stdout.readline()
    match = re.search(r"ready on (\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"{args[0]} did not start: {line!r}")
    return proc, match.group(1)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Target:
    """Generate through the router (Inference) or directly on a replica (Replica)."""

    def __init__(self, address: str, direct: bool):
        self.channel = grpc.aio.insecure_channel(address)
        self.direct = direct
        self.stub = (replica_pb2_grpc.ReplicaStub if direct else inference_pb2_grpc.InferenceStub)(self.channel)

    def call(self, max_tokens: int):
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if self.direct:
            return self.stub.Generate(replica_pb2.ReplicaGenerateRequest(prompt_token_ids=PROMPT, sampling=sampling))
        return self.stub.Generate(inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=PROMPT),
                                                                sampling=sampling))

    async def run(self, max_tokens: int) -> tuple[float, float, int]:
        """(seconds to first token, decode tokens/s after the first, tokens)."""
        t0 = time.perf_counter()
        first = last = None
        n = 0
        async for msg in self.call(max_tokens):
            if msg.HasField("chunk") and msg.chunk.token_ids:
                last = time.perf_counter()
                first = first or last
                n += len(msg.chunk.token_ids)
        rate = (n - 1) / max(last - first, 1e-6) if n > 1 else 0.0
        return first - t0, rate, n


async def ttft_and_rate(router_addr: str, replica_addr: str, args) -> dict:
    """Direct and router samples interleaved, so background load hits both paths alike."""
    targets = {"direct": Target(replica_addr, True), "router": Target(router_addr, False)}
    out = {name: {"ttft_ms": [], "rate": []} for name in targets}
    for target in targets.values():
        for _ in range(20):  # warm up connections and code paths
            await target.run(1)
    for _ in range(args.requests):
        for name, target in targets.items():
            out[name]["ttft_ms"].append((await target.run(1))[0] * 1e3)
    for _ in range(args.streams):
        for name, target in targets.items():
            out[name]["rate"].append((await target.run(args.stream_tokens))[1])
    for target in targets.values():
        await target.channel.close()
    return out


async def dispatch_rate(router_addr: str, args) -> float:
    target = Target(router_addr, False)
    for _ in range(20):
        await target.run(1)
    done = 0
    end = time.perf_counter() + args.dispatch_seconds

    async def client():
        nonlocal done
        while time.perf_counter() < end:
            await target.run(1)
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - t0
    await target.channel.close()
    return done / elapsed


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-s", type=float, default=2000.0, help="replica output rate per stream")
    p.add_argument("--requests", type=int, default=300, help="TTFT samples per path")
    p.add_argument("--stream-tokens", type=int, default=2000, help="tokens per stream for the rate figure")
    p.add_argument("--streams", type=int, default=5, help="streams per path for the rate figure")
    p.add_argument("--dispatch-seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=32, help="concurrent clients for the dispatch rate")
    p.add_argument("--record", metavar="FILE", help="append the figures to this markdown file")
    args = p.parse_args(argv)

    procs = []
    try:
        replica, replica_addr = start(["replica", "--engine", "paced", "--port", "0",
                                       "--tokens-per-s", str(args.tokens_per_s), "--grace", "0"])
        procs.append(replica)
        router, router_addr = start(["router", "--replica", replica_addr, "--port", "0"])
        procs.append(router)
        figures = asyncio.run(ttft_and_rate(router_addr, replica_addr, args))
        router.terminate()
        router.wait()
        # dispatch: a replica with many slots and a very fast engine, so the router is the limit
        fast, fast_addr = start(["replica", "--engine", "paced", "--port", "0", "--tokens-per-s", "1e6",
                                 "--max-batch", str(2 * args.concurrency), "--grace", "0"])
        procs.append(fast)
        router2, router2_addr = start(["router", "--replica", fast_addr, "--port", "0",
                                       "--queue-size", str(args.concurrency)])
        procs.append(router2)
        rps = asyncio.run(dispatch_rate(router2_addr, args))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()

    d, r = figures["direct"], figures["router"]
    added = [percentile(r["ttft_ms"], q) - percentile(d["ttft_ms"], q) for q in (50, 99)]
    loss = [1 - statistics.median(r["rate"]) / statistics.median(d["rate"]),
            1 - min(r["rate"]) / min(d["rate"])]
    lines = [
        f"- TTFT direct p50 {percentile(d['ttft_ms'], 50):.3f} ms / p99 {percentile(d['ttft_ms'], 99):.3f} ms; "
        f"via router p50 {percentile(r['ttft_ms'], 50):.3f} ms / p99 {percentile(r['ttft_ms'], 99):.3f} ms "
        f"({args.requests} requests each)",
        f"- **TTFT added by the router: p50 {added[0]:.3f} ms, p99 {added[1]:.3f} ms** (target <= 1 ms p50)",
        f"- decode rate at {args.tokens_per_s:.0f} tokens/s per stream ({args.stream_tokens} tokens, "
        f"{args.streams} streams): direct p50 {statistics.median(d['rate']):.1f} / worst {min(d['rate']):.1f}; "
        f"router p50 {statistics.median(r['rate']):.1f} / worst {min(r['rate']):.1f} tokens/s",
        f"- **tokens/s loss through the router: p50 {loss[0]:.2%}, worst stream {loss[1]:.2%}** (target <= 2%)",
        f"- **sustained dispatch rate: {rps:.0f} requests/s** (1-token requests, {args.concurrency} concurrent "
        f"clients, {args.dispatch_seconds:.0f} s, one replica with {2 * args.concurrency} slots)",
    ]
    print("\n".join(lines))
    if args.record:
        command = "python bench/router.py " + " ".join(argv if argv is not None else sys.argv[1:])
        machine = f"{platform.node()} ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()}), " \
                  f"Python {platform.python_version()}, grpcio {grpc.__version__}, " \
                  f"load average {os.getloadavg()[0]:.1f} at the end (shared machine)"
        section = [f"\n## Router overhead (bench/router.py)\n",
                   f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
                   f"- machine: {machine}; CPU only (PacedEngine replicas, no GPU)",
                   f"- commit: {git_commit()}", f"- command: `{command}`", *lines, ""]
        new_file = not Path(args.record).exists()
        with open(args.record, "a") as f:
            if new_file:
                f.write("# Benchmark results\n\nOne section per run: date, machine, commit, command, figures.\n")
            f.write("\n".join(section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
