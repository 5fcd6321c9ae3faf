"""Kill a replica *process* mid-stream: the request completes on another replica with exactly the
tokens an undisturbed greedy run produces; the dead replica is ejected, and re-admitted when a
replica serves on its address again."""

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from monoserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, inference_pb2, inference_pb2_grpc

from replicas.engine import SamplingParams
from replicas.testing import PacedEngine
from router.server import RouterServer

RATE = 100.0  # tokens/s of the replica processes


def start_replica(port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "replicas.cli_replica", "--engine", "paced", "--port", str(port),
         "--tokens-per-s", str(RATE), "--grace", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONPATH": ".:proto"})
    line = proc.stdout.readline()
    match = re.search(r"ready on (\S+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"replica process did not start: {line!r}")
    return proc, match.group(1)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_killed_replica_process_mid_stream_is_invisible_to_the_client(procs):
    a, b = start_replica(), start_replica()
    procs += [a[0], b[0]]
    by_address = {a[1]: a[0], b[1]: b[0]}
    router = RouterServer([a[1], b[1]])
    router.start()
    try:
        router.wait_ready(2)
        channel = grpc.insecure_channel(router.address)
        stub = inference_pb2_grpc.InferenceStub(channel)
        req = inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=[11, 12, 13]),
                                            sampling=common_pb2.SamplingParams(max_tokens=60))
        ids, final, killed = [], None, None
        for msg in stub.Generate(req, timeout=20):
            if msg.HasField("final"):
                final = msg.final
                continue
            ids += msg.chunk.token_ids
            if len(ids) == 20 and killed is None:
                killed = next(h.address for h in router.router.pool.replicas.values() if h.router_running)
                by_address[killed].send_signal(signal.SIGKILL)
        expected = list(PacedEngine(tokens_per_s=1e6).generate([11, 12, 13], SamplingParams(max_tokens=60)))
        assert ids == expected  # nothing lost, nothing repeated
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 60
        assert final.replica_id != killed
        assert router.metrics.registry.get_sample_value("monoserve_router_failovers_total") == 1

        # the dead replica is ejected ...
        admin = admin_pb2_grpc.RouterAdminStub(channel)
        states = {r.address: r.state for r in admin.ListReplicas(admin_pb2.ListReplicasRequest()).replicas}
        assert states[killed] == admin_pb2.REPLICA_STATE_EJECTED
        # ... and re-admitted once a replica serves on its address again
        port = int(killed.rsplit(":", 1)[1])
        procs.append(start_replica(port)[0])
        end = time.monotonic() + 10
        while time.monotonic() < end:
            states = {r.address: r.state for r in admin.ListReplicas(admin_pb2.ListReplicasRequest()).replicas}
            if states[killed] == admin_pb2.REPLICA_STATE_READY:
                break
            time.sleep(0.05)
        assert states[killed] == admin_pb2.REPLICA_STATE_READY
        channel.close()
    finally:
        router.stop()
